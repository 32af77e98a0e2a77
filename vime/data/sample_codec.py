"""A versioned binary codec for rollouts: groups of `Sample` dicts (+ a JSON dict of extra state) <-> bytes.

What the data buffer stores and sends. Nothing is ever unpickled: the numeric per-token fields are packed
little-endian arrays, everything else is JSON.

Layout (format version 1), all integers little-endian:

    magic b"VIMEROLL" | version u16 | reserved u16 | header_len u32 | body_crc32 u32 | header | arrays

`header` is UTF-8 JSON: {"groups": [[sample, ...], ...], "extra": {...}, "arrays": {field: {dtype, lengths}}}
where each packed field is left out of its sample dict; a sample whose value was None keeps it in the JSON
(and has length -1). `arrays` are each field's values of all samples concatenated, in the order of `arrays`.
The CRC32 covers header + arrays, so a truncated or bit-flipped payload is refused instead of mis-decoded.
Floats round-trip bit-exactly (float64); ints are stored as int32 when they fit, else int64.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

MAGIC = b"VIMEROLL"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHII")  # magic, version, reserved, header length, crc32 of everything after
# Sample fields packed as binary arrays, and the kind of number each holds.
PACKED_FIELDS = {"tokens": "int", "loss_mask": "int", "rollout_log_probs": "float"}
_ARRAY_DTYPES = ("<i4", "<i8", "<f8")


class SampleCodecError(ValueError):
    """Bytes that are not a rollout this version of vime can read."""


def encode_rollout(groups: list[list[dict]], extra: dict[str, Any] | None = None) -> bytes:
    """Groups of sample dicts (`Sample.to_dict()`) and a JSON-able `extra` dict -> bytes."""
    plain_groups = [[dict(s) for s in g] for g in groups]
    samples = [s for g in plain_groups for s in g]
    arrays, blobs = {}, []
    for name, kind in PACKED_FIELDS.items():
        values = [s.get(name) for s in samples]
        lengths = [-1 if v is None else len(v) for v in values]
        flat = [x for v in values if v is not None for x in v]
        packed = _pack(flat, kind)
        if packed is None:  # not plain numbers (e.g. bools or strings): leave this field in the JSON
            continue
        dtype, blob = packed
        for s, v in zip(samples, values):
            if v is not None:
                del s[name]
        arrays[name] = {"dtype": dtype, "lengths": lengths}
        blobs.append(blob)
    try:
        header = json.dumps({"groups": plain_groups, "extra": extra or {}, "arrays": arrays},
                            separators=(",", ":")).encode()
    except TypeError as e:
        raise SampleCodecError(f"a rollout must hold JSON values outside {sorted(PACKED_FIELDS)}: {e}") from e
    body = b"".join([header, *blobs])
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), zlib.crc32(body)) + body


def decode_rollout(data: bytes | bytearray | memoryview) -> tuple[list[list[dict]], dict[str, Any]]:
    """bytes -> (groups of sample dicts, extra). Raises SampleCodecError for anything it cannot trust."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise SampleCodecError(f"rollout payload too short ({len(data)} bytes) to hold the {_PREFIX.size}-byte header")
    magic, version, _, header_len, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SampleCodecError(f"not a vime rollout: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise SampleCodecError(f"rollout format version {version} is not readable by this vime (it reads version "
                               f"{FORMAT_VERSION}); use the vime version that wrote it")
    body = data[_PREFIX.size:]
    if zlib.crc32(body) != crc:
        raise SampleCodecError("rollout payload is corrupt: CRC32 mismatch (truncated or modified bytes)")
    if header_len > len(body):
        raise SampleCodecError(f"rollout header length {header_len} exceeds the payload ({len(body)} bytes)")
    try:
        header = json.loads(bytes(body[:header_len]))
        groups, extra, arrays = header["groups"], header["extra"], header["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        raise SampleCodecError(f"rollout header is not valid: {e}") from e
    try:
        _unpack_arrays(body, header_len, [s for g in groups for s in g], arrays)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SampleCodecError):
            raise
        raise SampleCodecError(f"rollout array table is not valid: {e!r}") from e
    return groups, extra


def _unpack_arrays(body: memoryview, offset: int, samples: list[dict], arrays: dict) -> None:
    for name, spec in arrays.items():
        lengths = spec["lengths"]
        if len(lengths) != len(samples):
            raise SampleCodecError(f"field {name!r}: {len(lengths)} lengths for {len(samples)} samples")
        if spec["dtype"] not in _ARRAY_DTYPES:
            raise SampleCodecError(f"field {name!r}: array dtype {spec['dtype']!r} is not one of {_ARRAY_DTYPES}")
        dtype = np.dtype(spec["dtype"])
        count = sum(n for n in lengths if n > 0)
        end = offset + count * dtype.itemsize
        if end > len(body):
            raise SampleCodecError(f"field {name!r} needs {end - offset} bytes, payload has {len(body) - offset}")
        flat = np.frombuffer(body[offset:end], dtype=dtype).tolist()
        offset = end
        pos = 0
        for s, n in zip(samples, lengths):
            if n >= 0:
                s[name] = flat[pos:pos + n]
                pos += n
    if offset != len(body):
        raise SampleCodecError(f"rollout payload has {len(body) - offset} unexpected trailing bytes")


def _pack(flat: list, kind: str) -> tuple[str, bytes] | None:
    """(dtype, bytes) of a flat list of numbers, or None when the values are not plain ints / floats."""
    if flat and type(flat[0]) is bool:  # a mask of bools stays JSON so that it decodes as bools
        return None
    arr = np.asarray(flat)
    if not flat:
        arr = np.zeros(0, dtype=np.int32 if kind == "int" else np.float64)
    if kind == "int" and arr.dtype.kind == "i":
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            return "<i8", arr.astype("<i8").tobytes()
        return "<i4", arr.astype("<i4").tobytes()
    if kind == "float" and arr.dtype.kind == "f":
        return "<f8", arr.astype("<f8").tobytes()
    return None
