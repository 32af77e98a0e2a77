"""Where checkpoints live, and how one becomes the one a resume starts from (no torch here: files only).

    SAVE/iter_0000003.partial/          being written: the actor's ranks, then the critic's (critic/)
    SAVE/iter_0000003/                  published: one atomic rename once every part is on disk
    SAVE/latest_checkpointed_iteration.txt   the commit marker (Megatron-LM's tracker), replaced atomically

A checkpoint is written into `iter_N.partial` and fsynced; `publish` renames it to `iter_N` and then moves the
marker, so a crash at any point leaves the previous checkpoint in charge and nothing half-written is ever
loaded. The marker covers actor, critic (`iter_N/critic`) and vime's state (`iter_N/vime_state.json`) at once.
A marker that cannot be read is ignored with a warning, and the newest complete checkpoint is used instead.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER_FILE = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
CRITIC_PART = "critic"  # the critic's part of an iteration's directory
STATE_FILE = "vime_state.json"
_ITERATION = re.compile(r"iter_(\d{7})")


def checkpoint_dir(root: str, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def partial_dir(root: str, rollout_id: int) -> Path:
    final = checkpoint_dir(root, rollout_id)
    return final.with_name(final.name + PARTIAL_SUFFIX)


def part_dir(iteration_dir: Path, role: str) -> Path:
    """Where `role` ("actor" or "critic") keeps its model and optimizer inside an iteration's directory."""
    return iteration_dir / CRITIC_PART if role == "critic" else iteration_dir


def read_marker(root: str) -> str | None:
    """The marker's tag ("release" or an iteration number as text); None when there is none or it is unreadable
    (then a warning says so)."""
    marker = Path(root) / MARKER_FILE
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    if tag == "release" or tag.isdigit():
        return tag
    logger.warning("checkpoint marker %s holds %r, not an iteration: ignored", marker, tag[:40])
    return None


def complete_iterations(root: str) -> list[int]:
    """Published iterations under `root` (those with vime's state file; a critic part where the run has one)."""
    found = []
    for entry in Path(root).iterdir() if Path(root).is_dir() else []:
        match = _ITERATION.fullmatch(entry.name)
        if match and (entry / STATE_FILE).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def resolve_checkpoint(root: str) -> Path | None:
    """The checkpoint under `root` to resume from: the marker's, or, when the marker is missing or unreadable but
    published checkpoints exist, the newest of them (with a warning). None: nothing to resume."""
    tag = read_marker(root)
    if tag is not None:
        path = Path(root) / (tag if tag == "release" else f"iter_{int(tag):07d}")
        if path.is_dir():
            return path
        logger.warning("checkpoint marker in %s names %s, which does not exist: ignored", root, path.name)
    iterations = complete_iterations(root)
    if not iterations:
        return None
    if (Path(root) / MARKER_FILE).exists():
        logger.warning("resuming from the newest complete checkpoint in %s instead: iteration %d", root,
                       iterations[-1])
    return checkpoint_dir(root, iterations[-1])


def fresh_partial(root: str, rollout_id: int) -> Path:
    """An empty `iter_N.partial` (a leftover of a crashed save is removed: it was never published)."""
    path = partial_dir(root, rollout_id)
    if path.exists():
        logger.warning("removing %s: an unpublished save left by an earlier run", path)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def fsync_tree(path: Path) -> None:
    """Every file and directory under `path` (and `path`) on disk."""
    for directory, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(root: str, tag: str) -> None:
    """Replace the marker atomically: a new file, fsynced, renamed over the old one."""
    tmp = Path(root) / f".{MARKER_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(root) / MARKER_FILE)
    _fsync_dir(Path(root))


def publish(root: str, rollout_id: int, retain: int | None = None, parts: tuple[str, ...] | list[str] = ("actor",)
            ) -> Path:
    """Make iteration `rollout_id`'s finished save (every role in `parts`) the one a resume starts from, then keep
    the newest `retain`."""
    partial, final = partial_dir(root, rollout_id), checkpoint_dir(root, rollout_id)
    for role in parts:
        if not (part_dir(partial, role) / STATE_FILE).is_file():
            raise RuntimeError(f"cannot publish {partial}: the {role}'s part is not a finished save (no {STATE_FILE})")
    if read_marker(root) == str(rollout_id):
        raise RuntimeError(f"{final} is the checkpoint a resume starts from; saving rollout {rollout_id} again "
                           "would replace it (is another run saving into this directory?)")
    fsync_tree(partial)
    if final.exists():  # published by a run that crashed before moving the marker: never the marked one
        stale = final.with_name(f"{final.name}.replaced-{int(time.time())}")
        logger.warning("%s exists but is not the marked checkpoint; replacing it (old copy removed)", final)
        os.replace(final, stale)
        shutil.rmtree(stale)
    os.replace(partial, final)
    _fsync_dir(Path(root))
    write_marker(root, str(rollout_id))
    if retain:
        prune(root, retain)
    return final


def prune(root: str, retain: int) -> list[int]:
    """Delete all but the newest `retain` published iterations (never the marked one); returns those deleted."""
    marked = read_marker(root)
    iterations = complete_iterations(root)
    doomed = [i for i in iterations[:-retain] if str(i) != marked]
    for i in doomed:
        shutil.rmtree(checkpoint_dir(root, i))
    if doomed:
        logger.info("--save-retain %d: deleted checkpoints %s from %s", retain, doomed, root)
    return doomed
