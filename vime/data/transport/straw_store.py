"""Rollouts on a shared directory with straw (`straw-queue`): durable, checksummed, replayable after a crash.

Layout under `--rollout-data-dir`:
    straw/                       straw's packed-record store (one sealed pack per rollout)
    index/rollout_00000012.json  the straw reference of rollout 12, written atomically after the data is durable

A rollout is "stored" once its index file exists; the index is what a restarted run reads to find rollouts to
replay. Each stored rollout is owned by a straw owner `vime:rollout:<id>` until trimmed, then garbage-collected.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from vime.data.sample_codec import decode_rollout, encode_rollout
from vime.data.transport.base import RolloutTransport

CODEC = "vime-rollout.v1"  # straw's record codec name; the payload carries its own format version too
RUN_ID = "vime"


@dataclass(frozen=True)
class StrawHandle:
    rollout_id: int
    ref: dict  # straw's RecordSetRef as a plain dict (JSON in the index, cheap to send through Ray)


class StrawTransport(RolloutTransport):
    durable = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.index_dir = self.root / "index"
        self._store = None  # opened on first use, once per process (straw stores must not cross a fork)

    @property
    def store(self):
        if self._store is None:
            from straw import SharedFilesystemStore

            (self.root / "straw").mkdir(parents=True, exist_ok=True)
            self.index_dir.mkdir(parents=True, exist_ok=True)
            self._store = SharedFilesystemStore(self.root / "straw", RUN_ID, codecs=("bytes.v1", CODEC),
                                                online_gc=True)
        return self._store

    def put(self, rollout_id, groups, extra):
        from straw import Record

        payload = encode_rollout(groups, extra)
        store = self.store
        ref = store.publish([Record(f"rollout-{rollout_id}", payload, codec=CODEC,
                                    metadata={"rollout_id": rollout_id})],
                            submission_id=f"rollout-{rollout_id}-{uuid.uuid4().hex}")  # durable on return
        store.retain(_owner(rollout_id), [ref])  # the rollout's own owner keeps it until trim()
        store.release_publications([ref])
        store.seal()  # one pack per rollout, so a trimmed rollout's pack can be reclaimed
        handle = StrawHandle(rollout_id, asdict(ref))
        _write_atomically(self.index_dir / _index_name(rollout_id),
                          json.dumps({"rollout_id": rollout_id, "ref": handle.ref}).encode())
        return handle

    def get(self, handle):
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
        return decode_rollout(records[0].payload)

    def stored(self):
        if not self.index_dir.is_dir():
            return {}
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
        for rollout_id in rollout_ids:
            (self.index_dir / _index_name(rollout_id)).unlink(missing_ok=True)  # not replayable from here on
            store.release(_owner(rollout_id))
        _fsync_dir(self.index_dir)
        store.collect_garbage()

    def close(self):
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getstate__(self):  # a transport sent to another process opens its own store there
        return {"root": self.root, "index_dir": self.index_dir, "_store": None}


def _owner(rollout_id: int) -> str:
    return f"vime:rollout:{rollout_id}"


def _index_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:08d}.json"


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
