"""The reward registry: `--rm-type NAME` looks NAME up in `RM_REGISTRY`.

A reward function is `fn(args, sample) -> float | dict`, sync or async. Adding a type is one decorated
function in a module that `rm_hub/__init__.py` imports.
"""

from __future__ import annotations

from typing import Callable

RM_REGISTRY: dict[str, Callable] = {}


def register_rm(name: str, *, needs_label: bool = True) -> Callable[[Callable], Callable]:
    """Register `fn` under `name`; `needs_label=False` lets samples without a label through."""

    def decorator(fn: Callable) -> Callable:
        if name in RM_REGISTRY:
            raise ValueError(f"reward type {name!r} is already registered ({RM_REGISTRY[name].__module__})")
        fn.needs_label = needs_label
        RM_REGISTRY[name] = fn
        return fn

    return decorator
