"""The files a run keeps in <output-dir>/rollouts/ for `python -m vime.inspect`, at the data layer so that both
their writers (the rollout manager, `vime.rollout.debug_data`; the training ranks, `vime.trainer.train_records`)
and their reader (`vime.inspect`) share one format without importing each other:

    rollout_<id>.jsonl.gz            the compact rollout (one sample dict a line; `vime.rollout.debug_data`)
    rollout_<id>.train.<rank>.jsonl.gz  what training rank <rank> computed for its share of that rollout: one
                                     `train_record` a line (its per-token log-probs and advantages)

All of them count against --save-rollouts-max-mb (`keep_under_cap`). Plain gzip JSON lines: nothing is pickled.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path
from typing import Iterable

ROLLOUTS_DIR = "rollouts"  # under --output-dir
LOG_PROB_DECIMALS = 5  # log-probs are kept to 1e-5: plenty to read, half the bytes of a full float
ADVANTAGE_DECIMALS = 5
_TRAIN_NAME = re.compile(r"^rollout_(?P<id>\d+)\.train\.(?P<rank>\d+)\.jsonl\.gz$")


# ---- writing, under the folder's size cap ------------------------------------------------------------------------

def write_gzip_lines(path: Path, rows: Iterable[dict]) -> Path:
    """`rows` as gzip JSON lines at `path`, written to a temporary name first: readers never see half a file. The
    file is its user's alone (0600) whatever the writing process's umask: a training rank on a Ray cluster vime did
    not start has the cluster's, not the run's 077 (what the model wrote may be private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb", opener=_private) as raw, gzip.open(raw, "wt", encoding="utf-8", compresslevel=1) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # half a file on a full disk would hold the space it ran out of
        raise
    return path


def _private(path: str, flags: int) -> int:
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a leftover .tmp of a crashed write keeps its old mode otherwise
    return fd


def keep_under_cap(path: Path, max_mb: float) -> Path | None:
    """Delete the oldest other files of `path`'s folder until it holds at most `max_mb` megabytes (the newest
    rollouts are the ones worth looking at). Returns `path`, or None when it alone is over the cap (then it is
    deleted, and nothing else is)."""
    cap = int(max_mb * 1024 * 1024)
    if path.stat().st_size > cap:
        path.unlink()
        return None
    others = sorted((_size_and_mtime(p) + (p,) for p in path.parent.glob("*.jsonl.gz") if p != path),
                    key=lambda entry: entry[1])
    total = path.stat().st_size + sum(size for size, _, _ in others)
    while total > cap and others:
        size, _, oldest = others.pop(0)
        total -= size
        oldest.unlink(missing_ok=True)  # another writer's trim (the manager, another rank) may be first
    return path


def _size_and_mtime(path: Path) -> tuple[int, float]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0, 0.0
    return st.st_size, st.st_mtime


def read_gzip_lines(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the trainer's side of a rollout ------------------------------------------------------------------------------

def train_records_path(output_dir: str | Path, rollout_id: int, rank: int) -> Path:
    return Path(output_dir) / ROLLOUTS_DIR / f"rollout_{rollout_id}.train.{rank}.jsonl.gz"


def train_record(position: int, sample: dict, log_probs: list[float] | None, advantages: list[float] | None,
                 log_probs_from: str | None) -> dict:
    """What a training rank keeps of one sample it trained: the keys that find the sample in the saved rollout
    (`match_train_records`), its per-token log-probs under the weights the rollout was sampled with (None where
    the rank did not compute them) and its per-token advantages (None for an SFT loss), rounded."""
    return {"position": position, "index": sample.get("index"), "group_index": sample.get("group_index"),
            "response_length": sample.get("response_length"),
            "log_probs": _rounded(log_probs, LOG_PROB_DECIMALS), "log_probs_from": log_probs_from,
            "advantages": _rounded(advantages, ADVANTAGE_DECIMALS)}


def _rounded(values: list[float] | None, decimals: int) -> list[float] | None:
    if values is None:
        return None
    return [round(float(x), decimals) if math.isfinite(x) else None for x in values]


def save_train_records(output_dir: str | Path, rollout_id: int, rank: int, records: list[dict],
                       max_mb: float) -> Path | None:
    """One rank's records of rollout `rollout_id`, kept under --save-rollouts-max-mb with the rollouts."""
    return keep_under_cap(write_gzip_lines(train_records_path(output_dir, rollout_id, rank), records), max_mb)


def read_train_records(rollouts_dir: Path, rollout_id: int) -> list[dict]:
    """Every rank's records of rollout `rollout_id` ([] when the trainer saved none: --debug-rollout-only, a
    rollout not trained yet or skipped, an older run)."""
    records = []
    for path in sorted(rollouts_dir.glob(f"rollout_{rollout_id}.train.*.jsonl.gz")):
        m = _TRAIN_NAME.match(path.name)
        if m and int(m["id"]) == rollout_id:
            records += read_gzip_lines(path)
    return records


def match_train_records(samples: list[dict], records: list[dict]) -> list[dict | None]:
    """The trainer's record of each saved sample, or None. A record names its sample by position in the rollout
    and by (group_index, index); it matches only a sample with the same group, index and response length (the
    rollout's order is the trainer's, but a copy reordered or a sample id reused must not pair the wrong
    numbers). Where the position disagrees, a (group_index, index) held by exactly one such sample decides."""
    by_key: dict[tuple, list[int]] = {}
    for pos, sample in enumerate(samples):
        by_key.setdefault(_key(sample), []).append(pos)
    matched: list[dict | None] = [None] * len(samples)
    for record in records:
        pos = record.get("position")
        if not (isinstance(pos, int) and 0 <= pos < len(samples) and _agrees(samples[pos], record)):
            candidates = [p for p in by_key.get(_key(record), []) if _agrees(samples[p], record)]
            pos = candidates[0] if len(candidates) == 1 else None
        if pos is not None and matched[pos] is None:
            matched[pos] = record
    return matched


def _key(row: dict) -> tuple:
    return row.get("group_index"), row.get("index")


def _agrees(sample: dict, record: dict) -> bool:
    n = sample.get("response_length")
    return (_key(sample) == _key(record) and n == record.get("response_length")
            and all(record.get(k) is None or len(record[k]) == n for k in ("log_probs", "advantages")))
