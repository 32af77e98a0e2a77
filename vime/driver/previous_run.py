"""Whether a run may start over what an earlier run left in its directories, checked before anything starts.

A fresh run takes over its directories: it empties the trained-sample record and lets stored rollouts go. So a
run whose --save, --output-dir or --rollout-data-dir holds an earlier run's checkpoints, trained-sample ids or
stored rollouts refuses to start unless it resumes that run (--load pointing at a checkpoint) or was told to
start over (--overwrite-output). `--load DIR` with nothing to resume in DIR is an error, except in the resume
idiom of Megatron-LM and slime scripts, `--load DIR --save DIR`, whose first run finds DIR empty.
"""

from __future__ import annotations

import os
from pathlib import Path

from vime.config.rollout import DataBufferConfig
from vime.config.run import JobConfig
from vime.config.train import MegatronConfig
from vime.trainer.megatron.checkpoint_files import MARKER_FILE, complete_iterations, resolve_checkpoint
from vime.transport.rollouts.replay import TRAINED_SAMPLES


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def earlier_state(args, stored_rollouts: int) -> list[str]:
    """What an earlier run left where this one writes (empty when nothing)."""
    megatron = MegatronConfig.of(args)
    job = JobConfig.of(args)
    data_buffer = DataBufferConfig.of(args)
    found = []
    if megatron.save and (complete_iterations(megatron.save) or (Path(megatron.save) / MARKER_FILE).exists()):
        found.append(f"checkpoints in --save {megatron.save}")
    trained = Path(job.output_dir) / TRAINED_SAMPLES
    if trained.is_file() and trained.stat().st_size:
        found.append(f"trained-sample ids in {trained}")
    if stored_rollouts:
        found.append(f"{stored_rollouts} stored rollouts in --rollout-data-dir {data_buffer.rollout_data_dir}")
    return found


def check_start(args, stored_rollouts: int) -> None:
    """Raise (naming what and where) unless this run may start here; see the module docstring."""
    megatron = MegatronConfig.of(args)
    job = JobConfig.of(args)
    if megatron.load:
        if resolve_checkpoint(megatron.load) is not None:
            return  # resuming: what is in the directories is this run's own past
        if not _same_dir(megatron.load, megatron.save):
            raise ValueError(f"--load {megatron.load}: no checkpoint to resume there (no {MARKER_FILE} and no "
                             "published iter_* directory); point it at the --save directory of an earlier run, or "
                             "drop --load to start from --hf-checkpoint")
    found = earlier_state(args, stored_rollouts)
    if found and not job.overwrite_output:
        raise ValueError("this run's directories hold an earlier run's state: " + "; ".join(found) +
                         ". Resume that run with --load <its --save directory>, or pass --overwrite-output to start "
                         "over (its trained-sample ids and stored rollouts are then discarded; its checkpoints are "
                         "replaced as this run saves)")
