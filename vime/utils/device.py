"""What kind of machine this process computes on, the precision training runs in there, and the address its
servers bind to."""

from __future__ import annotations


def use_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def training_dtype(args) -> str:
    """The dtype name (torch / vLLM spelling) the trainer computes in: float32 on CPU whatever the flags
    (bfloat16 is several times slower there); bfloat16 / float16 on GPU with --bf16 / --fp16."""
    if not use_gpu():
        return "float32"
    if args.bf16:
        return "bfloat16"
    return "float16" if args.fp16 else "float32"


def serving_host(args) -> str:
    """Address engines and the router bind to: this node's address on a cluster, loopback otherwise."""
    import ray

    if getattr(args, "ray_address", None) and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
