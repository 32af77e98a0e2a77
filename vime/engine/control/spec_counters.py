"""Speculative decoding's acceptance per rollout, from each engine's own counters (vLLM's Prometheus `/metrics`:
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`), read before and after the
rollout.

    rollout/spec_acceptance_rate       accepted draft tokens / proposed draft tokens
    rollout/spec_mean_accepted_length  tokens a verification step yields: 1 + accepted / drafts (vLLM's "mean
                                       acceptance length": the target's own token plus the accepted drafts)
    rollout/spec_draft_tokens          draft tokens proposed in the rollout

An engine whose counters went down restarted during the rollout: its counts since the restart are its rollout's.
"""

from __future__ import annotations

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def parse_counters(text: str) -> dict[str, float]:
    """{"drafts", "draft_tokens", "accepted"} summed over every label set in a Prometheus text (a counter's
    sample carries `_total`); zeros for counters the text lacks."""
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if not rest:  # no labels: "name value"
            name, _, rest = line.partition(" ")
        name = name.strip().removesuffix("_total")
        if name in COUNTERS:
            try:
                out[COUNTERS[name]] += float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    return out


def rollout_spec_metrics(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """The rollout's acceptance from the counters of every engine ({url: parse_counters(...)}) before and after it;
    {} when no engine proposed a draft token."""
    total = dict.fromkeys(COUNTERS.values(), 0.0)
    for url, now in after.items():
        then = before.get(url) or {}
        restarted = any(now[k] < then.get(k, 0.0) for k in total)
        for k in total:
            total[k] += now[k] if restarted else now[k] - then.get(k, 0.0)
    if total["draft_tokens"] <= 0:
        return {}
    return {"rollout/spec_acceptance_rate": total["accepted"] / total["draft_tokens"],
            "rollout/spec_mean_accepted_length": 1.0 + total["accepted"] / max(total["drafts"], 1.0),
            "rollout/spec_draft_tokens": total["draft_tokens"]}
