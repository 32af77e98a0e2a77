"""Rollouts on a shared directory with straw (`straw-queue`): durable, checksummed, replayable after a crash.

Layout under `--rollout-data-dir`:
    straw/                       straw's packed-record store (one sealed pack per rollout)
    index/rollout_00000012.json  the straw reference of rollout 12, written atomically after the data is durable
    pending/rollout_00000012.json  rollout 12's owner may exist without its index file (a put or trim under way)

A rollout is "stored" once its index file exists; the index is what a restarted run reads to find rollouts to
replay. Each stored rollout is owned by a straw owner `vime:rollout:<id>` until trimmed, then garbage-collected.
straw cannot list its owners, so put() and trim() mark the window in which an owner and the index disagree; a
crash inside it leaves the mark, and the next start (`stored()`) releases that owner unless the index has the
rollout, so its pack is collected instead of kept forever.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from vime.data.sample_codec import decode_rollout, encode_rollout
from vime.transport.rollouts.base import RolloutTransport

CODEC = "vime-rollout.v1"  # straw's record codec name; the payload carries its own format version too
RUN_ID = "vime"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StrawHandle:
    rollout_id: int
    ref: dict  # straw's RecordSetRef as a plain dict (JSON in the index, cheap to send through Ray)


class StrawTransport(RolloutTransport):
    durable = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.index_dir = self.root / "index"
        self.pending_dir = self.root / "pending"
        self._store = None  # opened on first use, once per process (straw stores must not cross a fork)

    @property
    def store(self):
        if self._store is None:
            from straw import SharedFilesystemStore

            (self.root / "straw").mkdir(parents=True, exist_ok=True)
            self.index_dir.mkdir(parents=True, exist_ok=True)
            self.pending_dir.mkdir(parents=True, exist_ok=True)
            self._store = SharedFilesystemStore(self.root / "straw", RUN_ID, codecs=("bytes.v1", CODEC),
                                                online_gc=True)
        return self._store

    def put(self, rollout_id, groups, extra):
        from straw import Record

        payload = encode_rollout(groups, extra)
        store = self.store
        self._mark_pending([rollout_id])  # from here until the index is written, a crash orphans the owner
        ref = store.publish([Record(f"rollout-{rollout_id}", payload, codec=CODEC,
                                    metadata={"rollout_id": rollout_id})],
                            submission_id=f"rollout-{rollout_id}-{uuid.uuid4().hex}")  # durable on return
        store.retain(_owner(rollout_id), [ref])  # the rollout's own owner keeps it until trim()
        store.release_publications([ref])
        store.seal()  # one pack per rollout, so a trimmed rollout's pack can be reclaimed
        handle = StrawHandle(rollout_id, asdict(ref))
        _write_atomically(self.index_dir / _index_name(rollout_id),
                          json.dumps({"rollout_id": rollout_id, "ref": handle.ref}).encode())
        (self.pending_dir / _index_name(rollout_id)).unlink()  # a lost unlink is harmless: the index has it
        return handle

    def get(self, handle, vocab_size=None):
        from straw import RecordSetRef

        ref = RecordSetRef.from_dict(handle.ref)
        try:
            records = list(self.store.read(ref))
        except Exception as e:  # straw raises its own typed errors; say which rollout and where
            raise RuntimeError(f"rollout {handle.rollout_id} could not be read from {self.root}: {e!r}; "
                               f"delete its index file {self.index_dir / _index_name(handle.rollout_id)} to "
                               f"generate it again") from e
        if len(records) != 1 or records[0].codec != CODEC:
            raise RuntimeError(f"rollout {handle.rollout_id} in {self.root} is not a {CODEC} record "
                               f"({[r.codec for r in records]})")
        return decode_rollout(records[0].payload, vocab_size)

    def stored(self):
        """The indexed rollouts, after releasing the owners a crashed put() or trim() left unindexed. Call it at
        start, before this run writes: a put() under way in another process would look crashed."""
        if not self.index_dir.is_dir():
            return {}
        self._release_orphans()
        handles = {}
        for path in sorted(self.index_dir.glob("rollout_*.json")):
            entry = json.loads(path.read_text())
            handles[entry["rollout_id"]] = StrawHandle(entry["rollout_id"], entry["ref"])
        return handles

    def trim(self, rollout_ids):
        rollout_ids = list(rollout_ids)
        if not rollout_ids:
            return
        store = self.store
        self._mark_pending(rollout_ids)  # a crash after an index unlink would orphan the owner
        for rollout_id in rollout_ids:
            (self.index_dir / _index_name(rollout_id)).unlink(missing_ok=True)  # not replayable from here on
            store.release(_owner(rollout_id))
        _fsync_dir(self.index_dir)
        store.collect_garbage()
        for rollout_id in rollout_ids:
            (self.pending_dir / _index_name(rollout_id)).unlink()

    def _mark_pending(self, rollout_ids) -> None:
        for rollout_id in rollout_ids:
            path = self.pending_dir / _index_name(rollout_id)
            _write_atomically(path, json.dumps({"rollout_id": rollout_id}).encode(), sync_dir=False)
        _fsync_dir(self.pending_dir)

    def _release_orphans(self) -> None:
        """Release the owner of every pending rollout the index lacks, and collect the packs that frees."""
        if not self.pending_dir.is_dir():
            return
        marks = sorted(self.pending_dir.glob("rollout_*.json"))
        if not marks:
            return
        store = self.store
        orphans = [i for i in (json.loads(p.read_text())["rollout_id"] for p in marks)
                   if not (self.index_dir / _index_name(i)).exists()]
        for rollout_id in orphans:
            store.release(_owner(rollout_id))  # idempotent: a crash before retain left no owner to release
        stats = store.collect_garbage()
        for path in [*marks, *self.pending_dir.glob("*.tmp-*")]:  # only once the releases are durable
            path.unlink()
        if orphans:
            logger.warning("released the straw owners of rollouts %s in %s, which a crash left unindexed "
                           "(reclaimed %d pack files)", orphans, self.root, stats["reclaimed_files"])

    def close(self):
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getstate__(self):  # a transport sent to another process opens its own store there
        return {**self.__dict__, "_store": None}


def _owner(rollout_id: int) -> str:
    return f"vime:rollout:{rollout_id}"


def _index_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:08d}.json"


def _write_atomically(path: Path, data: bytes, sync_dir: bool = True) -> None:
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
