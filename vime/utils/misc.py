"""Small helpers shared across packages."""

from __future__ import annotations

import argparse
import importlib
import random
import socket
from pathlib import Path
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
    """A port free on `host` now, for a server that binds it a few seconds later.

    Chosen outside the kernel's ephemeral range: every outgoing connection on the node (Ray's, gloo's, a test
    client's) takes a port from that range, and one of them may land on a port picked by bind(0) before the
    server binds it. Falls back to bind(0) where the range leaves no room below it.
    """
    low, high = _listen_range()
    if high - low >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(low, high)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listen_range() -> tuple[int, int]:
    """Ports for listeners: above Ray's worker ports (10002-19999 by default), below the ephemeral range."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    return 20000, ephemeral_low


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
