"""What a training rank keeps of each rollout for the inspector (`vime.data.saved_rollouts`, `vime.inspect`): per
sample of its share, the log-probs under the weights the rollout was sampled with and the advantages it trained on.

One rank per data-parallel share writes: the last pipeline stage (the only one with log-probs), tensor-parallel
rank 0 (the others hold the same numbers); the actor only, and nothing with --no-save-rollouts. The numbers are on
the host already when the rollout ends (`passes.OnHost` gathers the first step's log-probs in one copy; old
log-probs and advantages are kept there), so writing costs no device sync.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from megatron.core import parallel_state

from vime.config.run import DebugConfig, JobConfig
from vime.data.saved_rollouts import save_train_records, train_record
from vime.trainer.passes import OnHost, is_last_stage
from vime.trainer.train_batch import TrainBatch

logger = logging.getLogger(__name__)


def saves_train_records(args, role: str) -> bool:
    """Whether this rank writes its share's records (call after Megatron's groups are set up)."""
    debug = DebugConfig.of(args)
    job = JobConfig.of(args)
    return (role == "actor" and bool(debug.save_rollouts)
            and job.output_dir is not None and is_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def write_train_records(args, rollout_id: int, groups: list[list[dict]], batch: TrainBatch, local: list[int],
                        first_step_log_probs: OnHost | None) -> None:
    """This rank's share of the rollout (`local`, sample positions): per sample its log-probs (the old log-probs
    where computed, else the first step's forward, `first_step_log_probs`; None for a sample no forward computed)
    and its advantages, in <output-dir>/rollouts/rollout_<id>.train.<rank>.jsonl.gz. A failed write is logged, not
    raised: the file is for people, not for training."""
    job = JobConfig.of(args)
    debug = DebugConfig.of(args)
    samples = [d for g in groups for d in g]
    if batch.old_log_probs is not None:
        source, computed = "old_log_probs", {i: batch.old_log_probs[i] for i in local
                                             if batch.old_log_probs[i] is not None}
    else:
        source, computed = "first_step", first_step_log_probs.gather() if first_step_log_probs is not None else {}
    log_probs = {i: t.tolist() for i, t in computed.items()}
    advantages = {i: batch.advantages[i].tolist() for i in local} if batch.advantages is not None else {}
    records = [train_record(i, samples[i], log_probs.get(i), advantages.get(i), source if i in log_probs else None)
               for i in local]
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if save_train_records(job.output_dir, rollout_id, rank, records, debug.save_rollouts_max_mb) is None:
            logger.warning("rollout %d: rank %d's trainer records alone are over --save-rollouts-max-mb; not kept",
                           rollout_id, rank)
    except OSError as e:
        logger.warning("rollout %d: could not save rank %d's trainer records for the inspector: %s", rollout_id,
                       rank, e)
