"""Where the writers of a weight update put it: a fresh private directory under the weight root, files created
new and renamed into place.

    path = stage_dir(weight_root(update_weight_dir), "vime_weights_3_")  # driver: mkdtemp, mode 0700
    write_new_file(Path(path), "model-pp0.safetensors", write)          # a training writer

The default root (/dev/shm/vime-<uid>, `weight_files.default_weight_root`) sits in a directory every user can
write to, so it must be this user's own and private, or nothing is staged there: someone else could otherwise
make it first and read or swap the weights. Each update gets a directory of an unpredictable name (an existing
one is never reused), and each file is created with O_EXCL|O_NOFOLLOW (a file or link already at its name is
an error, never written through) under a temporary name, then renamed, so engines see only complete files. The
engine side (`vime.engine.in_vllm.weight_loading.update_files`) reads nothing else.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from vime.engine.protocol.weight_files import default_weight_root


def ensure_root(root: str) -> None:
    """Create `root` (mode 0700) if missing; the default root must then be a directory of this user's that no one
    else can use (no link, owned by this uid, no group or other permissions)."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link: refused below (the default root), or by mkdtemp
    if os.path.abspath(root) != default_weight_root():
        return  # --update-weight-dir: the user's choice (a shared mount); each update's directory is still 0700
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"weight root {root} is not a private directory of this user (uid {os.getuid()}; "
                              f"found uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): someone else may read "
                              f"or replace the weights there. Remove it, or pass --update-weight-dir DIR")


def stage_dir(root: str, prefix: str) -> str:
    """A new directory for one update under `root`: unpredictable name, mode 0700, never an existing one."""
    ensure_root(root)
    return tempfile.mkdtemp(prefix=prefix, dir=root)


def write_new_file(directory: Path, name: str, write: Callable[[BinaryIO], None]) -> Path:
    """`write(f)` into a new file (mode 0600) renamed to directory/name once complete."""
    tmp = directory / f".{name}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(f"{tmp} exists before vime created it: a weight update's files are made new in a "
                              f"directory of its own, so something else wrote there; use a fresh directory") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, directory / name)  # a rename replaces a link at `name` itself, never its target
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return directory / name
