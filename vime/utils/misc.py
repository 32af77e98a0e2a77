"""Small helpers shared across packages."""

from __future__ import annotations

import argparse
import importlib
import socket
from typing import Any, Callable


def with_values(args: argparse.Namespace, **values: Any) -> argparse.Namespace:
    """A copy of `args` with `values` set. Derived flags go into a new namespace, never onto a parsed one that
    other code (or another process) already holds."""
    return argparse.Namespace(**{**vars(args), **values})


def load_function(path: str) -> Callable[..., Any]:
    """Import `pkg.module.name` (or `pkg.module:name`) and return the object.

    This is the extension seam: every `--*-path` flag is resolved through here.
    """
    module_path, sep, name = path.replace(":", ".").rpartition(".")
    if not sep or not module_path:
        raise ValueError(f"function path {path!r} must look like 'package.module.function'")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_path!r} for function path {path!r}: {e}") from e
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {module_path!r} has no attribute {name!r} (function path {path!r})") from None


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
