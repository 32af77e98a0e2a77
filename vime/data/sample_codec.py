"""A versioned binary codec for rollouts: groups of `Sample` dicts (+ a JSON dict of extra state) <-> bytes.

What the data buffer stores and sends. Nothing is ever unpickled: the numeric per-token fields are packed
little-endian arrays, everything else is JSON.

Layout (format version 1; 2 when a rollout holds integer tensors), all integers little-endian:

    magic b"VIMEROLL" | version u16 | reserved u16 | header_len u32 | body_crc32 u32 | header | arrays

`header` is UTF-8 JSON: {"groups": [[sample, ...], ...], "extra": {...}, "arrays": {field: {dtype, lengths}}}
where each packed field is left out of its sample dict; a sample whose value was None keeps it in the JSON
(and has length -1). `arrays` are each field's values of all samples concatenated, in the order of `arrays`.
The CRC32 covers header + arrays, so a truncated or bit-flipped payload is refused instead of mis-decoded.
Floats round-trip bit-exactly (float64); ints are stored as int32 when they fit, else int64.

Version 2 adds `tensors`: {field: {dtype, shapes}} for the n-dimensional integer fields (`TENSOR_FIELDS`: the
routed experts of MoE routing replay, [tokens - 1, layers, top-k] per sample), each sample's array stored
C-ordered in the narrowest of uint8 / uint16 / int32 / int64 that holds it, after the version-1 arrays; they
decode as numpy arrays. A sample without one has shape None.

Decoding also checks every sample against the `Sample` contract (`vime.utils.types.check_sample_dict`: field
types, tokens / response_length / loss_mask / rollout_log_probs lengths, finite log-probs, and token ids below the
vocabulary size when the reader passes one), so what a training rank reads is safe to embed.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

import numpy as np

from vime.utils.types import InvalidSampleError, check_sample_dict

MAGIC = b"VIMEROLL"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sHHII")  # magic, version, reserved, header length, crc32 of everything after
# Sample fields packed as binary arrays, and the kind of number each holds.
PACKED_FIELDS = {"tokens": "int", "loss_mask": "int", "rollout_log_probs": "float"}
_ARRAY_DTYPES = ("<i4", "<i8", "<f8")
# Sample fields holding integer arrays of any shape (numpy, or nested lists after JSON)
TENSOR_FIELDS = ("rollout_routed_experts",)
_TENSOR_DTYPES = ("|u1", "<u2", "<i4", "<i8")


class SampleCodecError(ValueError):
    """Bytes that are not a rollout this version of vime can read, or a rollout holding an invalid sample (then
    `sample_index`, its position in the rollout, and `field` say which)."""

    def __init__(self, message: str, field: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.field, self.sample_index = field, sample_index


def encode_rollout(groups: list[list[dict]], extra: dict[str, Any] | None = None) -> bytes:
    """Groups of sample dicts (`Sample.to_dict()`) and a JSON-able `extra` dict -> bytes."""
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(s, dict) for s in g)
                                               for g in groups):
        raise SampleCodecError("a rollout is a list of groups, each a list of sample dicts (Sample.to_dict())")
    plain_groups = [[dict(s) for s in g] for g in groups]
    samples = [s for g in plain_groups for s in g]
    arrays, blobs = {}, []
    for name, kind in PACKED_FIELDS.items():
        values = [s.get(name) for s in samples]
        if not all(v is None or isinstance(v, (list, tuple)) for v in values):
            continue  # not a sequence: left in the JSON, where the decoder's sample check names it
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
    tensors = _pack_tensors(samples, blobs)
    table = {"groups": plain_groups, "extra": extra or {}, "arrays": arrays}
    if tensors:
        table["tensors"] = tensors
    try:
        header = json.dumps(table, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as e:  # a non-JSON type, a circular reference
        raise SampleCodecError(f"a rollout must hold JSON values outside {sorted(PACKED_FIELDS)}: {e}") from e
    body = b"".join([header, *blobs])
    version = FORMAT_VERSION if tensors else 1  # version-1 readers still read rollouts without tensors
    return _PREFIX.pack(MAGIC, version, 0, len(header), zlib.crc32(body)) + body


def json_ready(sample: dict) -> dict:
    """A sample dict whose tensor fields are nested lists: what `json.dumps` takes (saved rollouts, state)."""
    out = dict(sample)
    for name in TENSOR_FIELDS:
        if isinstance(out.get(name), np.ndarray):
            out[name] = out[name].tolist()
    return out


def _pack_tensors(samples: list[dict], blobs: list[bytes]) -> dict:
    tensors = {}
    for name in TENSOR_FIELDS:
        try:
            values = [None if s.get(name) is None else np.asarray(s[name]) for s in samples]
        except (TypeError, ValueError) as e:  # ragged nested lists
            raise SampleCodecError(f"field {name!r} must hold rectangular integer arrays: {e}") from e
        if all(v is None for v in values):
            continue
        filled = [v for v in values if v is not None and v.size]
        bad = next((v for v in filled if v.dtype.kind not in "iu"), None)
        if bad is not None:
            raise SampleCodecError(f"field {name!r} must hold integers, got an array of {bad.dtype}")
        lo = min((int(v.min()) for v in filled), default=0)
        hi = max((int(v.max()) for v in filled), default=0)
        dtype = next(d for d in _TENSOR_DTYPES if np.iinfo(np.dtype(d)).min <= lo and hi <= np.iinfo(np.dtype(d)).max)
        for s, v in zip(samples, values):
            if v is not None:
                blobs.append(np.ascontiguousarray(v, dtype=dtype).tobytes())
                del s[name]
        tensors[name] = {"dtype": dtype, "shapes": [None if v is None else list(v.shape) for v in values]}
    return tensors


def decode_rollout(data: bytes | bytearray | memoryview,
                   vocab_size: int | None = None) -> tuple[list[list[dict]], dict[str, Any]]:
    """bytes -> (groups of sample dicts, extra). Raises SampleCodecError for anything it cannot trust: damaged
    bytes, and samples that break the `Sample` contract (with token ids checked against `vocab_size` when the
    reader knows it: the trainer passes its model's)."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise SampleCodecError(f"rollout payload too short ({len(data)} bytes) to hold the {_PREFIX.size}-byte header")
    magic, version, _, header_len, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SampleCodecError(f"not a vime rollout: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in _READABLE_VERSIONS:
        raise SampleCodecError(f"rollout format version {version} is not readable by this vime (it reads versions "
                               f"{_READABLE_VERSIONS}); use the vime version that wrote it")
    body = data[_PREFIX.size:]
    if zlib.crc32(body) != crc:
        raise SampleCodecError("rollout payload is corrupt: CRC32 mismatch (truncated or modified bytes)")
    if header_len > len(body):
        raise SampleCodecError(f"rollout header length {header_len} exceeds the payload ({len(body)} bytes)")
    try:
        header = json.loads(bytes(body[:header_len]))
        groups, extra, arrays = header["groups"], header["extra"], header["arrays"]
        tensors = header.get("tensors") or {}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise SampleCodecError(f"rollout header is not valid: {e!r}") from e
    if not (isinstance(groups, list) and all(isinstance(g, list) and all(isinstance(s, dict) for s in g)
                                             for g in groups)):
        raise SampleCodecError("rollout header is not valid: groups must be lists of sample objects")
    if not (isinstance(extra, dict) and isinstance(arrays, dict) and isinstance(tensors, dict)
            and all(isinstance(spec, dict) for spec in [*arrays.values(), *tensors.values()])):
        raise SampleCodecError("rollout header is not valid: extra, arrays and tensors must be objects")
    samples = [s for g in groups for s in g]
    try:
        offset = _unpack_arrays(body, header_len, samples, arrays)
        offset = _unpack_tensors(body, offset, samples, tensors)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        if isinstance(e, SampleCodecError):
            raise
        raise SampleCodecError(f"rollout array table is not valid: {e!r}") from e
    if offset != len(body):
        raise SampleCodecError(f"rollout payload has {len(body) - offset} unexpected trailing bytes")
    for i, sample in enumerate(samples):
        try:
            check_sample_dict(sample, vocab_size)
        except InvalidSampleError as e:
            raise SampleCodecError(f"rollout sample {i} (index {sample.get('index')!r}) is invalid: {e}",
                                   field=e.field, sample_index=i) from e
    return groups, extra


def _field_dtype(name: str, spec: dict, per_sample: str, num_samples: int, allowed: tuple[str, ...]) -> np.dtype:
    """A packed field's dtype, once its table has one entry (`per_sample`) per sample and an allowed dtype."""
    if len(spec[per_sample]) != num_samples:
        raise SampleCodecError(f"field {name!r}: {len(spec[per_sample])} {per_sample} for {num_samples} samples")
    if spec["dtype"] not in allowed:
        raise SampleCodecError(f"field {name!r}: array dtype {spec['dtype']!r} is not one of {allowed}")
    return np.dtype(spec["dtype"])


def _field_end(name: str, body: memoryview, offset: int, nbytes: int) -> int:
    if offset + nbytes > len(body):
        raise SampleCodecError(f"field {name!r} needs {nbytes} bytes, payload has {len(body) - offset}")
    return offset + nbytes


def _unpack_arrays(body: memoryview, offset: int, samples: list[dict], arrays: dict) -> int:
    for name, spec in arrays.items():
        lengths = spec["lengths"]
        dtype = _field_dtype(name, spec, "lengths", len(samples), _ARRAY_DTYPES)
        end = _field_end(name, body, offset, sum(n for n in lengths if n > 0) * dtype.itemsize)
        flat = np.frombuffer(body[offset:end], dtype=dtype).tolist()
        offset = end
        pos = 0
        for s, n in zip(samples, lengths):
            if n >= 0:
                s[name] = flat[pos:pos + n]
                pos += n
    return offset


def _unpack_tensors(body: memoryview, offset: int, samples: list[dict], tensors: dict) -> int:
    for name, spec in tensors.items():
        dtype = _field_dtype(name, spec, "shapes", len(samples), _TENSOR_DTYPES)
        for s, shape in zip(samples, spec["shapes"]):
            if shape is None:
                continue
            if any(not isinstance(d, int) or d < 0 for d in shape):
                raise SampleCodecError(f"field {name!r}: bad shape {shape!r}")
            end = _field_end(name, body, offset, math.prod(shape) * dtype.itemsize)  # Python ints: no wrap
            s[name] = np.frombuffer(body[offset:end], dtype=dtype).reshape(shape).copy()
            offset = end
    return offset


def _pack(flat: list, kind: str) -> tuple[str, bytes] | None:
    """(dtype, bytes) of a flat list of numbers, or None when the values are not plain ints / floats."""
    if flat and type(flat[0]) is bool:  # a mask of bools stays JSON so that it decodes as bools
        return None
    if not set(map(type, flat)) <= {int, float} and not all(  # the common case first, checked in C
            isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) for x in flat):
        return None  # strings, nested lists, ...: JSON
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
