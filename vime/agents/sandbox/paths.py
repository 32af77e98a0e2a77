"""Which paths a sandboxed program sees, and whether its uid can reach them: the directories hidden from it, the
interpreter it runs, the prefixes it may read.

    hidden = hidden_dirs()                                     # /tmp, /home, /root, ... and this user's home
    python = default_python(is_root=True, hidden=hidden)       # this run's interpreter, if the sandbox uid can run it
    unreachable_step("/root/x/.venv/bin/python", hidden)       # None, or the directory that stops another uid

As root every run executes as a uid of its own (slots.py), so a path is usable only where *other* users may search
every directory on the way. Where the jail hides shared directories behind an empty tmpfs (masking.py), the
directories above a bound-back path are the tmpfs's own, searchable by all: a checkout, a venv or an interpreter
under /home, /tmp or /root (0700) is reachable there, though not outside the jail.
"""

from __future__ import annotations

import os
import sys
import tempfile

from vime.agents.sandbox.masking import beneath

# hidden behind an empty tmpfs where a mount namespace allows (masking.py): where other processes keep sockets,
# shared memory and secrets
MASKED_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm", "/home", "/root")
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


def hidden_dirs() -> list[str]:
    """Every directory a masking jail hides: MASKED_DIRS, this user's home and the temp directory."""
    return [*MASKED_DIRS, os.path.expanduser("~"), tempfile.gettempdir()]


def prefix_of(python: str) -> str:
    """The installation a Python executable belongs to (<prefix>/bin/python)."""
    return os.path.dirname(os.path.dirname(python))


def python_prefixes(python: str) -> list[str]:
    """What an interpreter reads: its prefix, the prefix its symlinks lead to and, for this process's own
    interpreter, the venv and the base installation."""
    prefixes = {prefix_of(python), prefix_of(os.path.realpath(python))}
    if python == sys.executable:
        prefixes |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return sorted(prefixes)


def _jail_made(directory: str, kept: str, hidden: list[str]) -> bool:
    """Whether the jail makes `directory` itself: above the kept path `kept`, at or beneath a hidden directory."""
    real_hidden = [os.path.realpath(h) for h in hidden]
    return directory != kept and beneath(kept, directory) and any(beneath(directory, h) for h in real_hidden)


def unreachable_step(path: str, hidden: list[str] | None = None, kept: str | None = None) -> str | None:
    """The first directory on the way to `path` (real or through its symlinks) that another uid may not search,
    `path` itself when it is not executable by others, or None. `hidden`: what the jail hides, with `kept` (default:
    the path's Python prefix) bound back beneath it."""
    hidden = hidden or []
    for way in dict.fromkeys([os.path.abspath(path), os.path.realpath(path)]):
        keep = os.path.realpath(kept or prefix_of(way))
        directory = os.path.dirname(way)
        while True:
            if not _jail_made(os.path.realpath(directory), keep, hidden):
                try:
                    if not os.stat(directory).st_mode & 0o001:
                        return directory
                except OSError:
                    return directory
            parent = os.path.dirname(directory)
            if parent == directory:
                break
            directory = parent
    try:
        return None if os.stat(path).st_mode & 0o001 else path
    except OSError:
        return path


def default_python(is_root: bool, hidden: list[str] | None = None) -> str:
    """This interpreter, unless the sandbox's own uid could not run it (as root: a directory on the way that others
    may not search and the jail does not replace); then a system one every uid may run."""
    if not is_root or unreachable_step(sys.executable, hidden) is None:
        return sys.executable
    for candidate in SYSTEM_PYTHONS:
        if os.path.exists(candidate) and unreachable_step(candidate, hidden) is None:
            return candidate
    raise RuntimeError(
        f"no Python the sandbox's uid may run: {unreachable_step(sys.executable, hidden)} (on the way to "
        f"{sys.executable}) is not searchable by other users, and neither of {', '.join(SYSTEM_PYTHONS)} is "
        "usable; make that directory searchable (chmod o+x), install a system python3, or pass "
        "LocalSandbox(python=...) of an interpreter every user can run")
