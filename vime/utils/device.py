"""What kind of machine this process computes on, the precision training runs in there, and the address its
servers bind to."""

from __future__ import annotations

import glob

from vime.config.run import JobConfig
from vime.config.train import MegatronConfig

# What a GPU driver puts in /dev (NVIDIA's devices, ROCm's kernel driver, WSL's GPU): without any of them CUDA
# cannot be available to torch.
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def use_gpu() -> bool:
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return False  # no GPU driver on this node: no import of torch (1-2 s) for it in processes that need none
    import torch

    return torch.cuda.is_available()


def local_device():
    """The torch device this process computes on: its current GPU where CUDA is available, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def training_dtype(args) -> str:
    """The dtype name (torch / vLLM spelling) the trainer computes in: float32 on CPU whatever the flags
    (bfloat16 is several times slower there); bfloat16 / float16 on GPU with --bf16 / --fp16."""
    megatron = MegatronConfig.of(args)
    if not use_gpu():
        return "float32"
    if megatron.bf16:
        return "bfloat16"
    return "float16" if megatron.fp16 else "float32"


def serving_host(args) -> str:
    """Address this node's servers that other nodes call (engines, the trainers' rendezvous) bind to: loopback
    unless the run is on a cluster, and there the address of --serving-interface, or else the one Ray uses."""
    job = JobConfig.of(args)
    import ray

    if not (job.ray_address and ray.is_initialized()):
        return "127.0.0.1"
    if job.serving_interface:
        return interface_address(job.serving_interface)
    return ray_node_address()


def ray_node_address() -> str:
    """The address this process's Ray node registered (`ray start --node-ip-address`), from the cluster's node
    table. Not `ray.util.get_node_ip_address()`: in an actor it guesses the interface of the default route, which
    is not the node's address where a node was given one (a second network, several nodes on one machine)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this process's Ray node {node_id} is not in the cluster's node table")


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this node."""
    import socket

    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise ValueError(f"--serving-interface {name}: no such interface on this node (it has "
                         f"{', '.join(sorted(interfaces))})")
    for address in interfaces[name]:
        if address.family == socket.AF_INET:
            return address.address
    raise ValueError(f"--serving-interface {name}: the interface has no IPv4 address")


def cluster_has_gpus() -> bool:
    """Whether the run's actors compute on GPUs: the cluster's resources, not this process's devices (a driver on a
    CPU-only head node places GPU actors)."""
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
