"""Saved rollouts: one `Sample.to_dict()` JSON object per line, readable by people and by
`--load-debug-rollout-data` (`save_rollout`); and the compact copy every run keeps under <output-dir>/rollouts/ for
`python -m vime.inspect` (`save_compact_rollout`)."""

from __future__ import annotations

import json
from pathlib import Path

from vime.data.sample_codec import json_ready
from vime.data.saved_rollouts import (LOG_PROB_DECIMALS, ROLLOUTS_DIR, keep_under_cap, read_gzip_lines,
                                      write_gzip_lines)
from vime.data.sample import Sample


def rollout_path(template: str, rollout_id: int) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def save_rollout(template: str, rollout_id: int, groups: list[list[Sample]]) -> Path:
    path = rollout_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for group in groups:
                for sample in group:
                    f.write(json.dumps(json_ready(sample.to_dict()), ensure_ascii=False) + "\n")
        tmp.replace(path)  # readers never see a half-written file
    except BaseException:
        tmp.unlink(missing_ok=True)  # half a file on a full disk would hold the space it ran out of
        raise
    return path


def load_rollout(template: str, rollout_id: int) -> list[list[Sample]]:
    """Read a saved rollout back into groups (consecutive samples with the same group_index)."""
    path = rollout_path(template, rollout_id)
    if not path.is_file():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id})")
    groups: list[list[Sample]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                sample = Sample.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a saved Sample: {e}") from None
            if groups and groups[-1][0].group_index == sample.group_index:
                groups[-1].append(sample)
            else:
                groups.append([sample])
    return groups


# ---- the compact rollouts every run keeps for `python -m vime.inspect` -------------------------------------------

def compact_sample(sample: Sample | dict) -> dict:
    """The sample as `Sample.to_dict()` gives it, without what is too big to look at (the routed experts) and with
    its log-probs rounded to LOG_PROB_DECIMALS places. A dict (a `to_dict()` the caller already made) is not
    copied deeply."""
    d = dict(sample) if isinstance(sample, dict) else sample.to_dict()
    d.pop("rollout_routed_experts", None)
    if d.get("rollout_log_probs") is not None:
        d["rollout_log_probs"] = [round(float(x), LOG_PROB_DECIMALS) for x in d["rollout_log_probs"]]
    return json_ready(d)


def compact_rollout_path(output_dir: str | Path, name: str) -> Path:
    return Path(output_dir) / ROLLOUTS_DIR / f"{name}.jsonl.gz"


def save_compact_rollout(output_dir: str | Path, name: str, groups: list[list[Sample | dict]],
                         max_mb: float) -> Path | None:
    """Write `groups` (samples, or their `to_dict()`s) to <output_dir>/rollouts/<name>.jsonl.gz (gzip JSON lines,
    one compact sample a line, the groups' samples consecutive), then delete the oldest other files there (rollouts
    and the trainer's records of them) until the folder holds at most `max_mb` megabytes (the newest rollouts are
    the ones worth looking at). Returns the path, or None when the file alone
    is over the cap (it is not kept, and nothing else is deleted)."""
    path = write_gzip_lines(compact_rollout_path(output_dir, name),
                            (compact_sample(sample) for group in groups for sample in group))
    return keep_under_cap(path, max_mb)


def read_compact_rollout(path: str | Path) -> list[dict]:
    """The sample dicts of a file written by `save_compact_rollout`, in order."""
    return read_gzip_lines(path)
