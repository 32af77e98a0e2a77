"""Crash replay with a durable transport: which stored rollouts a resumed run trains from storage, and the
record of which sample ids were trained.

A run resumed from the checkpoint of rollout k starts at k + 1. Rollouts k + 1, k + 2, ... that the crashed run
had already stored are trained from storage instead of generated again, and the data source continues from
the state stored with the last of them, so no sample is lost or trained twice.

`<output-dir>/trained_samples.jsonl` has one line per trained rollout: {"rollout_id", "sample_ids", "replayed"}.
On resume it is cut back to the rollouts inside the loaded checkpoint (training after it was undone by the
crash), so it always lists exactly the samples the current weights were trained on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vime.transport.rollouts.base import RolloutRef, RolloutTransport, rollout_summary

logger = logging.getLogger(__name__)

TRAINED_SAMPLES = "trained_samples.jsonl"


def replay_ids(stored_ids, start: int) -> list[int]:
    """The stored rollouts to replay: the unbroken run start, start + 1, ... (a gap ends it)."""
    stored, ids = set(stored_ids), []
    while start + len(ids) in stored:
        ids.append(start + len(ids))
    return ids


def plan_replay(transport: RolloutTransport, start: int, output_dir, resuming: bool,
                data_dir) -> dict[int, RolloutRef]:
    """The stored rollouts a run starting at rollout `start` trains from storage ({rollout id: RolloutRef}); the
    rest of what `transport` holds is let go: all of it when the run does not resume (`resuming` False:
    --overwrite-output, an earlier run's rollouts are not this one's to train), else those inside the checkpoint
    and those after a gap. The trained-samples record is cut back to `start` first."""
    truncate_trained_samples(output_dir, start)
    stored = transport.stored()
    if not stored:
        return {}
    if not resuming:
        logger.warning("--overwrite-output: dropping %d rollouts stored in %s by an earlier run", len(stored), data_dir)
        transport.trim(list(stored))
        return {}
    ids = replay_ids(stored, start)
    transport.trim([i for i in stored if i not in ids])  # already in the checkpoint, or after a gap
    if ids:
        logger.info("replaying rollouts %d..%d from %s before generating again", ids[0], ids[-1], data_dir)
    return {i: stored_rollout(transport, stored[i]) for i in ids}


def stored_rollout(transport: RolloutTransport, handle) -> RolloutRef:
    """A rollout stored by an earlier (crashed) run, with the summary the driver keeps of it (rollouts stored
    before the summary was part of their extra get it from their samples)."""
    groups, extra = transport.get(handle)
    return RolloutRef(handle, {**rollout_summary(groups), **extra})


def read_trained_samples(output_dir) -> list[dict]:
    path = Path(output_dir) / TRAINED_SAMPLES
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a kill mid-write: that rollout was never checkpointed
            continue
    return records


def truncate_trained_samples(output_dir, start: int) -> None:
    """Keep the records of rollouts before `start` (the ones the resumed weights contain), atomically."""
    path = Path(output_dir) / TRAINED_SAMPLES
    if not path.exists():
        return
    kept = [r for r in read_trained_samples(output_dir) if r["rollout_id"] < start]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def append_trained_samples(output_dir, rollout_id: int, sample_ids: list[int], replayed: bool) -> None:
    path = Path(output_dir) / TRAINED_SAMPLES
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rollout_id": rollout_id, "sample_ids": list(sample_ids), "replayed": replayed}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
