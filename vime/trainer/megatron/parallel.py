"""Start and stop torch.distributed plus Megatron's model-parallel groups in a training process.

Who calls it: each Megatron training process (one per rank) before building its model, the convert tools,
and the tests. Rendezvous follows torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); rank 0's store listens on MASTER_ADDR alone, not on every interface as torch's own would
(`vime.utils.rendezvous`). Without WORLD_SIZE it starts a one-process group, whose store is in memory.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from vime.trainer.megatron.cpu_compat import apply_cpu_compat
from vime.utils.rendezvous import master_store


def init_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, seed: int = 1234,
                  timeout_s: float = 1800.0, expert_model_parallel_size: int = 1,
                  expert_tensor_parallel_size: int | None = None) -> None:
    """Initialise the process group (gloo on CPU, nccl on GPU), Megatron's TP/PP/DP (and expert) groups and RNG
    seeds.

    Seeds follow Megatron-LM: every stage gets `seed + 100 * pp_rank` for the Python and torch default
    generators, and the tensor-parallel RNG tracker is seeded from it (`model_parallel_cuda_manual_seed`).
    Applies the CPU compatibility layer when CUDA is absent. Safe to call once per process.
    """
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        apply_cpu_compat()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "WORLD_SIZE" in os.environ:
            if on_gpu:
                torch.cuda.set_device(device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
            dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout, **_rendezvous_from_env(timeout))
        else:  # no other process to meet: no socket either
            dist.init_process_group("nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    world_size = dist.get_world_size()
    if world_size % (tensor_model_parallel_size * pipeline_model_parallel_size):
        raise ValueError(f"world size {world_size} is not a multiple of tensor x pipeline parallel size "
                         f"({tensor_model_parallel_size} x {pipeline_model_parallel_size})")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                             expert_model_parallel_size=expert_model_parallel_size,
                                             expert_tensor_parallel_size=expert_tensor_parallel_size)
    set_seed(seed)


def _rendezvous_from_env(timeout: timedelta) -> dict:
    """`init_process_group`'s store, rank and world size from torchrun's environment: rank 0 serves the store on
    MASTER_ADDR:MASTER_PORT alone, the others connect to it. Under torchrun's agent (which serves the store itself)
    nothing: torch joins the agent's."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return {}
    rank, world_size = int(_required_env("RANK")), int(os.environ["WORLD_SIZE"])
    host, port = _required_env("MASTER_ADDR"), int(_required_env("MASTER_PORT"))
    store = master_store(host, port, world_size, timeout) if rank == 0 else \
        dist.TCPStore(host, port, world_size, False, timeout)
    return {"store": store, "rank": rank, "world_size": world_size}


def _required_env(name: str) -> str:
    if name not in os.environ:
        raise ValueError(f"WORLD_SIZE is set but {name} is not: a multi-process group needs RANK, MASTER_ADDR and "
                         "MASTER_PORT too (torchrun sets them all); unset WORLD_SIZE for a one-process group")
    return os.environ[name]


def device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank: the one it sees when Ray showed it its bundle's GPU alone, else (torchrun: every
    GPU of the node visible) the one its LOCAL_RANK names."""
    if visible == 1:
        return 0
    if not 0 <= local_rank < visible:
        raise ValueError(f"LOCAL_RANK {local_rank} names no GPU: this process sees {visible} (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start one rank per GPU")
    return local_rank


def set_seed(seed: int) -> None:
    """Seed this rank's generators the Megatron-LM way (needs `parallel_state` initialised)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the process group (the trainer's and tests' last call), and Megatron's
    per-layer MoE loss tracker: it is sized by the torn-down model's layers, and a next model with more MoE layers
    in the same process would index past it."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
