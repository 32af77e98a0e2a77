"""Run `MegatronTrainer` in tests: in this process (`local_trainer`), or in fresh processes, one per rank
(`launch`), that report through files.

    with local_trainer(hf_dir, "--loss-type", "sft_loss") as t: ...   # tears Megatron's groups down after
    reports = launch(spec, out_dir, world_size)                        # blocks until every rank is done

Each launched process runs `main(SPEC.json, RANK)` (`python trainer_runs.py SPEC.json RANK` by hand; the tests fork
it from a server that imported the trainer once, `tests.helpers.warm_start`): it builds the trainer from `spec["argv"]`
(`vime.arguments.parse_args`; `spec["args"]`, optional, sets values on the parsed args), trains the rollouts
`spec["train"]` on `spec["data"][str(rollout_id)]`, optionally saves and publishes (`spec["save"]`: the rollout
id to save) or dies inside a save
(`spec["killed_in_save"]`, exit code 17), optionally exports (`spec["save_hf"]`: a directory), and writes
OUT/rank<r>.json ({"metrics": {rollout_id: metrics}, "step", "loaded_state"}) and, with `spec["weights"]`,
OUT/weights_rank<r>.pt (the `hf_weights()` of its pipeline stage, on CPU). A fresh process per phase makes a
checkpoint restart a real kill-and-restart, and gives multi-rank runs their own process groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# 4 prompts x 4 samples per rollout, micro-batches of 2. --load-debug-rollout-data only satisfies the argument
# check: the trainer is handed its rollouts and reads no file. --no-save-rollouts: a test that wants the trainer's
# records for the inspector turns it back on with an --output-dir of its own (else they land in ./outputs/run).
BASE_ARGV = ["--debug-train-only", "--no-save-rollouts", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl",
             "--rm-type", "math",
             "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "2", "--lr", "1e-3"]


@contextlib.contextmanager
def local_trainer(hf_dir, *extra: str):
    """A one-process trainer in this process with BASE_ARGV + extra; Megatron's groups are destroyed after."""
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(hf_dir), *BASE_ARGV, *extra])
    try:
        yield MegatronTrainer(args)
    finally:
        destroy_parallel()


def skip_without_a_gpu_per_rank(world_size: int) -> None:
    """On a GPU machine ranks train on CUDA, a GPU each (NCCL refuses two ranks on one GPU): skip a test of more
    ranks than GPUs there. CPU machines run any number of ranks over gloo."""
    import pytest
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs; this machine has {torch.cuda.device_count()}")


def launch(spec: dict, out_dir: Path, world_size: int = 1, timeout_s: float = 180.0,
           expect_exit: int | None = None) -> list[dict] | None:
    """Start the ranks, wait for all, raise with the log of the first that fails; returns each rank's report.
    `expect_exit`: every rank must exit with this code instead (a run killed on purpose); returns None."""
    from tests.helpers import warm_start
    from vime.utils.misc import find_free_port

    skip_without_a_gpu_per_rank(world_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "world_size": world_size, "port": find_free_port(),
                                     "out": str(out_dir)}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("WORLD_SIZE", None)
    logs = [out_dir / f"rank{rank}.log" for rank in range(world_size)]
    procs = [warm_start.start(main, (str(spec_path), rank), log, env, REPO) for rank, log in enumerate(logs)]
    try:
        failed = warm_start.wait_for_all(procs, timeout_s, expect_exit)
    except TimeoutError:
        raise RuntimeError(f"trainer workers did not finish within {timeout_s} s") from None
    if failed is not None:
        raise RuntimeError(f"trainer worker rank {failed} exited with {procs[failed].exitcode}:\n"
                           f"{logs[failed].read_text()[-6000:]}")
    if expect_exit is not None:
        return None
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def main(spec_path: str, rank: int) -> None:
    import torch

    torch.set_num_threads(1)
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.arguments import parse_args

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    # the ranks are this helper's processes, not Ray's: say how many, as a run's placement flags would
    args = parse_args([*spec["argv"], "--actor-num-gpus-per-node", str(spec["world_size"])])
    if spec.get("args"):  # values set on the parsed args, as a flag not (yet) on the command line would
        from vime.utils.misc import with_values

        args = with_values(args, **spec["args"])
    trainer = MegatronTrainer(args, rank, spec["world_size"], "127.0.0.1", spec["port"],
                              total_steps=spec.get("total_steps", 1000), local_rank=rank)  # one node: a GPU each
    try:
        metrics = {r: trainer.train(r, spec["data"][str(r)]) for r in spec["train"]}
        if spec.get("save") is not None:
            trainer.save(spec["save"], {})
            if rank == 0:  # what the run's driver does once every part is saved (checkpoint_files.publish)
                from vime.trainer.megatron.checkpoint_files import publish

                publish(args.save, spec["save"])
        if spec.get("killed_in_save") is not None:  # the process dies inside the model's save: exit code 17
            from unittest import mock

            from vime.trainer.megatron import checkpoint

            real_save = checkpoint.dist_checkpointing.save

            def save_then_die(*a, **kw):
                real_save(*a, **kw)  # the model's files are written, the part is not finished
                os._exit(17)

            with mock.patch.object(checkpoint.dist_checkpointing, "save", save_then_die):
                trainer.save(spec["killed_in_save"], {})
        if spec.get("save_hf"):
            trainer.save_hf(spec["save_hf"])
        if spec.get("weights"):
            weights = {name: t.detach().cpu().clone() for name, t in trainer.hf_weights()}  # loadable anywhere
            torch.save(weights, out / f"weights_rank{rank}.pt")
        report = {"metrics": metrics, "step": trainer.step, "loaded_state": trainer.get_loaded_state()}
        (out / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        destroy_parallel()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main(sys.argv[1], int(sys.argv[2]))
