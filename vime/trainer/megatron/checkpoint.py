"""torch_dist checkpoints of model, optimizer, scheduler, RNG and step, in Megatron-LM's directory layout.

    SAVE/iter_0000003/                  dist_checkpointing (model under "model", optimizer under "optimizer")
    SAVE/iter_0000003/vime_state.json   rollout id, step, scheduler, data-source state
    SAVE/iter_0000003/rng/rank_<r>.pt   each rank's RNG states
    SAVE/iter_0000003/critic/           the critic's part, the same files (PPO)
    SAVE/latest_checkpointed_iteration.txt

Saved into iter_N.partial and published by one rename and a marker move (`checkpoint_files`): a crash mid-save
leaves the previous checkpoint in charge.

The tools in tools/ write the same layout ("release" for a converted HF checkpoint), so `--load` accepts both.

Loading runs no code from the files (`no_code_from_files`). Megatron reads common.pt with `torch.load`; torch DCP
reads each byte item of the .distcp files with `torch.load(weights_only=False)` and `.metadata` with a plain
`pickle.load`. While a checkpoint loads, every `torch.load` is weights_only (torch's own
TORCH_FORCE_WEIGHTS_ONLY_LOAD switch, which overrides an explicit weights_only=False; its restricted unpickler builds
tensors, containers, and the plain classes Megatron registers as safe) and `.metadata` is read by an unpickler
that builds DCP's metadata classes only. torch 2.13 defaults `torch.load` to weights_only=True anyway; the switch
keeps it so under a user's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 and covers DCP's explicit False.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import random
import threading
import time
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.optimizer import distrib_optimizer
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from vime.trainer.megatron.checkpoint_files import (MARKER_FILE, STATE_FILE, fresh_partial, part_dir,
                                                           partial_dir, resolve_checkpoint)
from vime.config.train import MegatronConfig
from vime.trainer.megatron.model import use_fused_adam

logger = logging.getLogger(__name__)

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # set together with the former, torch.load raises

# What torch DCP's `.metadata` pickle refers to (torch 2.13, checked on vime's checkpoints and DCP's own): plain
# dataclasses, enums, torch.Size, dtypes, paths, and a lookup of torch layouts by name.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath"},  # StorageMeta.checkpoint_id, when the writer was given a Path
}


class DcpMetadataUnpickler(pickle.Unpickler):
    """Reads torch DCP's `.metadata`: finds only DCP_METADATA_GLOBALS and torch dtypes, so it can call nothing
    else."""

    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_GLOBALS.get(module, ()) or module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of torch DCP's metadata: the file was "
            f"not written by torch.distributed.checkpoint (or a newer torch added a class: add it to "
            f"DCP_METADATA_GLOBALS in {__name__} once you checked that it is plain data); nothing was run")


class _DcpPickle:
    """Stands in for the `pickle` module in torch DCP's filesystem reader while a checkpoint loads."""

    dump = staticmethod(pickle.dump)

    @staticmethod
    def load(file) -> object:
        return DcpMetadataUnpickler(file).load()


@contextlib.contextmanager
def no_code_from_files():
    """While it is open, loading a checkpoint unpickles only data (see the module docstring). Process-wide: it sets
    an environment variable and swaps DCP's reader's `pickle`, both put back on leaving."""
    saved_env = {key: os.environ.get(key) for key in (FORCE_WEIGHTS_ONLY, NO_WEIGHTS_ONLY)}
    saved_pickle = dcp_filesystem.pickle
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(NO_WEIGHTS_ONLY, None)
    dcp_filesystem.pickle = _DcpPickle
    try:
        yield
    finally:
        dcp_filesystem.pickle = saved_pickle
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_rng_state(path: Path) -> dict:
    """A rank's RNG states: tensors and plain values, read weights_only (torch's restricted unpickler: no code)."""
    return torch.load(path, weights_only=True)


def _init_adam_state(optimizer) -> None:
    """The per-parameter state an optimizer's first step would create (zeros, step 0), for each parameter that has
    none. torch's Adam (what Megatron wraps without apex/TE) creates it only at the first step, but a sharded state
    dict lists it: a fresh DistributedOptimizer needs it to load into, and a save before any step taken (every step
    so far skipped) needs it, or the checkpoint lacks what a resume's load asks for."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam):  # TE's / apex's FusedAdam: Megatron's own initialiser
            if getattr(opt, "init_state_fn", None) is not None:
                opt.init_state_fn(inner, opt.config)
            continue
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")  # torch keeps `step` with the parameter
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device
                                                          else "cpu"),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _per_optimizer(optimizer, loaded: dict) -> list[dict]:
    """A loaded optimizer state dict, one entry per optimizer of Megatron's ChainedOptimizer."""
    return [loaded] if len(optimizer.chained_optimizers) == 1 else [v for _, v in sorted(loaded.items())]


def _step_zero_where_missing(optimizer, loaded: dict) -> None:
    """megatron-core 0.16.1 saves the step its parameters share only when it is non-zero (`if step:`), so a
    checkpoint saved before any optimizer step was taken has none, and torch's Adam fails to load it: step 0 is
    what it was."""
    for state in _per_optimizer(optimizer, loaded):
        per_param = state.get("state", {})
        if "common_step" not in per_param:
            for param_state in per_param.values():
                if isinstance(param_state, dict) and param_state and "step" not in param_state:
                    param_state["step"] = 0.0  # torch's Adam makes it a tensor where its kernel wants it


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """After a DistributedOptimizer load without apex/TE, give each parameter its own `step` with the
    checkpoint's value: megatron-core 0.16.1 shares one step tensor among all parameters (torch's Adam then adds
    1 per parameter per step) and the dp_reshardable parameter state copies the template's step over it."""
    for opt, state in zip(optimizer.chained_optimizers, _per_optimizer(optimizer, loaded)):
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                param_state = opt.optimizer.state.get(p, {})
                if "step" in param_state:
                    param_state["step"] = torch.tensor(step, device=adam_step_device(group, p))


def adam_step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where torch's Adam keeps a parameter's `step`: with the parameter for the fused and capturable kernels
    (they refuse it elsewhere), on the CPU for the others (they read it on the host)."""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def place_adam_steps(optimizer) -> None:
    """Put every `step` of torch's Adam where its kernel reads it (`adam_step_device`), after a load: the
    checkpoint may have been saved by another kernel or on another device (a CPU run resumed on a GPU), and the
    DistributedOptimizer's load leaves them on the CPU."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    inner.state[p]["step"] = step.to(adam_step_device(group, p), torch.float32)


def _sharded_state(trainer, is_loading: bool, with_optimizer: bool = True) -> dict:
    """The template dist_checkpointing saves or fills. Without `with_optimizer` the optimizer is left untouched:
    building its sharded state (even to load) fills Adam's state with moments but no `step`, which torch's Adam
    then fails on at the first step ("KeyError: 'step'")."""
    model_sd = trainer.model[0].module.sharded_state_dict()
    state = {"model": model_sd}
    if trainer.optimizer is not None and with_optimizer:
        distributed = MegatronConfig.of(trainer.args).use_distributed_optimizer
        if not is_loading or (distributed and not distrib_optimizer.HAVE_APEX_OR_TE):
            _init_adam_state(trainer.optimizer)
        kwargs = {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}} if distributed else {}
        state["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)
    return state


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if compatible_tracker_states(tracker.get_states(), state["tracker"]):
        tracker.set_states(state["tracker"])
    else:  # saved on another kind of device: a CPU generator's state in a CUDA tracker fails at its next fork
        logger.warning("the checkpoint's model-parallel RNG states were saved on another kind of device (sizes %s, "
                       "this one's %s): they keep this run's seed instead", _sizes(state["tracker"]),
                       _sizes(tracker.get_states()))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def compatible_tracker_states(current: dict, saved: dict) -> bool:
    """Whether `saved` tracker states fit this process's tracker: the same names, each state of the same size (a
    CPU generator's state is 5,056 bytes, a CUDA Philox state 16)."""
    return set(current) == set(saved) and all(current[k].numel() == saved[k].numel() for k in current)


def _sizes(states: dict) -> dict:
    return {name: int(state.numel()) for name, state in states.items()}


def _exit_with_parent(parent: int) -> None:
    """In a multiprocessing Manager's server process: leave once `parent` is gone (checked every second)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start_results_queue() -> SyncManager | None:
    """Megatron's torch_dist saves collect their write results through a queue served by a multiprocessing Manager
    process, started at the first save. Megatron spawns it: a fresh interpreter that imports the parent's main
    module and torch again (~10 s of a core and ~460 MB on a small CPU, at every process's first save), and that
    outlives a rank killed mid-run (SIGKILL, a crash), one orphan per killed rank. Start it here, forked (it serves
    a queue and never runs torch code; Megatron forks its file writers likewise), with a watch that ends it with
    this process. Returns the Manager it started (None: one was there already)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return None
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    return manager


def save_checkpoint(trainer, root: str, rollout_id: int, extra_state: dict | None = None) -> Path:
    """Collective over the trainer's ranks: its part (`part_dir`: the actor's, or the critic's) of iteration
    `rollout_id`'s unpublished directory under `root`. The actor saves first and makes the directory fresh; the
    run publishes it once every part is saved (`checkpoint_files.publish`)."""
    rank = dist.get_rank()
    if rank == 0 and trainer.role != "critic":
        fresh_partial(root, rollout_id)
    dist.barrier()
    path = part_dir(partial_dir(root, rollout_id), trainer.role)
    if rank == 0:
        path.mkdir(exist_ok=True)
    dist.barrier()
    start_results_queue()
    dist_checkpointing.save(_sharded_state(trainer, is_loading=False), str(path))
    (path / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), path / "rng" / f"rank_{rank}.pt")
    dist.barrier()
    if rank == 0:  # last: a part with its state file is a finished part
        state = {"rollout_id": rollout_id, "step": trainer.step, "scheduler": trainer.scheduler.state_dict(),
                 **(extra_state or {})}
        (path / STATE_FILE).write_text(json.dumps(state))
    dist.barrier()
    return path


def load_model_weights(model, root: str) -> Path:
    """The model weights of the checkpoint a resume would start from under `root` (a --save directory or a
    converted one, "release"), loaded into `model` in this rank's layout: no optimizer, scheduler or RNG. Returns
    the iteration's directory; ValueError when `root` holds none. Collective."""
    iteration = resolve_checkpoint(root)
    if iteration is None:
        raise ValueError(f"{root} holds no torch_dist checkpoint (no {MARKER_FILE} and no iter_* directory); "
                         "convert an HF checkpoint with scripts/convert_hf_to_torch_dist.py, or pass the HF directory")
    with no_code_from_files():
        loaded = dist_checkpointing.load({"model": model[0].module.sharded_state_dict()}, str(part_dir(iteration,
                                                                                                       "actor")))
    model[0].module.load_state_dict(loaded["model"])
    return iteration


def load_checkpoint(trainer, root: str) -> dict | None:
    """Load the trainer's part of the checkpoint a resume starts from under `root` (`resolve_checkpoint`);
    returns its vime_state (None: nothing saved)."""
    iteration = resolve_checkpoint(root)
    if iteration is None:
        return None
    path = part_dir(iteration, trainer.role)
    if not path.is_dir():  # a critic's first run from an actor-only checkpoint (a converted one, "release")
        logger.info("no %s part in %s: the %s starts fresh", trainer.role, iteration, trainer.role)
        return None
    args = trainer.args
    megatron = MegatronConfig.of(args)
    release = iteration.name == "release"
    state_template = _sharded_state(trainer, is_loading=True,
                                    with_optimizer=not (release or megatron.no_load_optim or megatron.finetune))
    with no_code_from_files():
        loaded = dist_checkpointing.load(state_template, str(path))
    trainer.model[0].module.load_state_dict(loaded["model"])
    if "optimizer" in loaded:
        if not megatron.use_distributed_optimizer:
            _step_zero_where_missing(trainer.optimizer, loaded["optimizer"])
        with torch.no_grad():  # the distributed optimizer copies into views of leaf parameters
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        if megatron.use_distributed_optimizer and not distrib_optimizer.HAVE_APEX_OR_TE:
            _restore_adam_steps(trainer.optimizer, loaded["optimizer"])
        use_fused_adam(trainer.optimizer)  # the loaded param groups carry the saving run's kernel choice
        place_adam_steps(trainer.optimizer)
    else:
        trainer.optimizer.reload_model_params()
    if release or megatron.finetune:
        return {"rollout_id": -1, "step": 0}
    meta = json.loads((path / STATE_FILE).read_text())
    if not megatron.no_load_optim:
        trainer.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if not megatron.no_load_rng and rng_file.is_file():
        _set_rng_state(read_rng_state(rng_file))
    trainer.step = meta["step"]
    return meta
