"""The encoder of rollout format versions 1 and 2, as `vime.data.sample_codec` had it before version 3 (commit
34f2239), kept to test the reader on what earlier runs stored: byte for byte what tests/unit/data/rollout_v*.bin
hold (test_sample_codec checks it) and input to the reader's fuzz tests."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

PREFIX = struct.Struct("<8sHHII")
PACKED_FIELDS = {"tokens": "int", "loss_mask": "int", "rollout_log_probs": "float"}
TENSOR_FIELDS = ("rollout_routed_experts",)
TENSOR_DTYPES = ("|u1", "<u2", "<i4", "<i8")


def encode_v1_v2(groups: list[list[dict]], extra: dict | None = None) -> bytes:
    """Version 1, or 2 when a sample holds a tensor (the old encoder's validation of its input left out)."""
    plain_groups = [[dict(s) for s in g] for g in groups]
    samples = [s for g in plain_groups for s in g]
    arrays, blobs = {}, []
    for name, kind in PACKED_FIELDS.items():
        values = [s.get(name) for s in samples]
        if not all(v is None or isinstance(v, (list, tuple)) for v in values):
            continue
        packed = _pack([x for v in values if v is not None for x in v], kind)
        if packed is None:
            continue
        for s, v in zip(samples, values):
            if v is not None:
                del s[name]
        arrays[name] = {"dtype": packed[0], "lengths": [-1 if v is None else len(v) for v in values]}
        blobs.append(packed[1])
    tensors = {}
    for name in TENSOR_FIELDS:
        values = [None if s.get(name) is None else np.asarray(s[name]) for s in samples]
        if all(v is None for v in values):
            continue
        filled = [v for v in values if v is not None and v.size]
        lo, hi = min((int(v.min()) for v in filled), default=0), max((int(v.max()) for v in filled), default=0)
        dtype = next(d for d in TENSOR_DTYPES if np.iinfo(np.dtype(d)).min <= lo and hi <= np.iinfo(np.dtype(d)).max)
        for s, v in zip(samples, values):
            if v is not None:
                blobs.append(np.ascontiguousarray(v, dtype=dtype).tobytes())
                del s[name]
        tensors[name] = {"dtype": dtype, "shapes": [None if v is None else list(v.shape) for v in values]}
    table = {"groups": plain_groups, "extra": extra or {}, "arrays": arrays}
    if tensors:
        table["tensors"] = tensors
    header = json.dumps(table, separators=(",", ":")).encode()
    body = b"".join([header, *blobs])
    return PREFIX.pack(b"VIMEROLL", 2 if tensors else 1, 0, len(header), zlib.crc32(body)) + body


def _pack(flat: list, kind: str) -> tuple[str, bytes] | None:
    if flat and type(flat[0]) is bool:
        return None
    if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) for x in flat):
        return None
    arr = np.asarray(flat) if flat else np.zeros(0, dtype=np.int32 if kind == "int" else np.float64)
    if kind == "int" and arr.dtype.kind == "i":
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            return "<i8", arr.astype("<i8").tobytes()
        return "<i4", arr.astype("<i4").tobytes()
    if kind == "float" and arr.dtype.kind == "f":
        return "<f8", arr.astype("<f8").tobytes()
    return None
