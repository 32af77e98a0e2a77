"""A JSON cache of option tables read from an installed package (vLLM's engine options, megatron-core's config
fields), so that a run's driver parses its command line without importing that package: a few seconds each.

Keyed by the package's defining source files (path, size, mtime) and the table's format, under `VIME_CACHE_DIR`
(default ~/.cache/vime). A cache that cannot be read is rebuilt; one that cannot be written is only a slower start.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_path(name: str, sources: list[Path], table_format: int) -> Path | None:
    """Where the table `name` of the installed sources is cached; None when a source is missing."""
    parts = [str(table_format)]
    for source in sources:
        try:
            stat = source.stat()
        except OSError:
            return None
        parts.append(f"{source}|{stat.st_size}|{stat.st_mtime_ns}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()
    root = os.environ.get("VIME_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                    "vime")
    return Path(root) / f"{name}-{key[:16]}.json"


def cached_table(path: Path | None, build: Callable[[], list]) -> list:
    """The table at `path` if it reads, else `build()` (then written there)."""
    if path is not None and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # unreadable: rebuilt below
    table = build()
    if path is not None:
        write_atomically(path, json.dumps(table))
    return table


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (concurrent starts read a whole file or none);
    a cache that cannot be written is only a slower next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass
