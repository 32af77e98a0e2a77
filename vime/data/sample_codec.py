"""A versioned binary codec for rollouts: groups of `Sample` dicts (+ a dict of extra state) <-> bytes.

What the data buffer stores and sends. Nothing is ever unpickled: the body is MessagePack (msgspec), whose decoder
builds only plain values and never runs code.

Layout (format version 3), all prefix integers little-endian:

    magic b"VIMEROLL" | version u16 | reserved u16 | body_len u32 | body_crc32 u32 | body

`body` is one MessagePack map {"groups": [[sample, ...], ...], "extra": {...}}, each sample the `Sample.to_dict()`
map (its schema is `WireSample`, the one typed declaration of a sample on the wire) with its values as they are:
tokens, loss_mask and rollout_log_probs stay arrays of ints / floats (msgspec writes and reads them faster than
packing them, measured; floats are float64, so they round-trip bit-exactly).
The n-dimensional integer fields (`TENSOR_FIELDS`: the routed experts of MoE routing replay, [tokens - 1, layers,
top-k] per sample) are maps {"dtype", "shape", "data"}: `data` the C-ordered bytes in the narrowest of uint8 /
uint16 / int32 / int64 that holds the whole rollout's values; they decode as numpy arrays. An int beyond 64 bits
(which JSON carried) is MessagePack extension type 1 holding its decimal digits. The CRC32 covers the body, so a
truncated or bit-flipped payload is refused instead of mis-decoded.

Versions 1 and 2 (written by vime before version 3) stay readable, so that rollouts stored by earlier runs (straw's
files, for crash resume) still load. Their body is header | arrays: `header` (header_len bytes) is UTF-8 JSON
{"groups", "extra", "arrays": {field: {dtype, lengths}}, "tensors": {field: {dtype, shapes}}} (tensors: version 2)
with each packed field left out of its sample dict; the arrays are each field's values of all samples concatenated
("<i4", "<i8" or "<f8"; length -1 for None), then each sample's tensor C-ordered (shape None: no tensor).

Decoding checks every sample once, against the `Sample` contract: msgspec's decoder the field types (`WireSample`),
then `vime.data.sample.check_sample_values` how the values fit (tokens / response_length / loss_mask /
rollout_log_probs lengths, finite log-probs, token ids below the vocabulary size when the reader passes one), so what
a training rank reads is safe to embed, and the trainer builds its batch from it without checking again. Versions 1
and 2 carry JSON, whose types `check_sample_dict` checks.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from typing import Any

import msgspec
import numpy as np

from vime.data.sample import InvalidSampleError, check_sample_dict, check_sample_values, number_versions

MAGIC = b"VIMEROLL"
FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
_PREFIX = struct.Struct("<8sHHII")  # magic, version, reserved, header (v3: body) length, crc32 of the body
# Sample fields holding integer arrays of any shape (numpy, or nested lists after JSON), and their wire dtypes
TENSOR_FIELDS = ("rollout_routed_experts",)
_TENSOR_DTYPES = ("|u1", "<u2", "<i4", "<i8")
_ARRAY_DTYPES = ("<i4", "<i8", "<f8")  # versions 1 and 2: the packed tokens, loss_mask and rollout_log_probs
_TENSOR_KEYS = {"dtype", "shape", "data"}


class SampleCodecError(ValueError):
    """Bytes that are not a rollout this version of vime can read, or a rollout holding an invalid sample (then
    `sample_index`, its position in the rollout, and `field` say which)."""

    def __init__(self, message: str, field: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.field, self.sample_index = field, sample_index


class WireSample(msgspec.Struct, forbid_unknown_fields=True):
    """A `Sample` on the wire: its fields (`Sample.to_dict()`), typed, with the dataclass's defaults. Weight-version
    labels may be strings in rollouts stored before they became numbers; decoding makes them ints."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list = ""
    tokens: list[int] = []
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int | bool] | None = None
    rollout_log_probs: list[float] | None = None
    status: str = "pending"
    metadata: dict = {}
    weight_versions: list[int | str] = []
    weight_version_spans: list[list[int | str]] = []
    tools: list | None = None
    rollout_routed_experts: Any = None  # a tensor map {dtype, shape, data}, checked by `_tensors_from_wire`


# what a field holds, for the error that names it (msgspec's own says where, not what)
_WIRE_TYPES = {"group_index": "an integer or None", "index": "an integer or None", "prompt": "a string or messages",
               "tokens": "a list of integers (token ids)", "response": "a string", "response_length": "an integer",
               "reward": "a number, a dict or None", "loss_mask": "a list of 0/1 integers or None",
               "rollout_log_probs": "a list of real numbers or None", "status": "a string", "metadata": "a dict",
               "weight_versions": "a list of versions", "weight_version_spans": "a list of [version, start, end]",
               "tools": "a list or None"}
_WHERE = re.compile(r"`\$\.groups\[(\d+)\]\[(\d+)\](?:\.(\w+))?")


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """The version-3 body: decoding into it checks the structure and every sample's field types (msgspec's errors
    say where it breaks)."""
    groups: list[list[WireSample]]
    extra: dict


_BIG_INT = 1  # MessagePack extension code: an int beyond 64 bits, as its decimal digits (JSON held any int)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):  # a numpy scalar, e.g. a token id taken from an array
        return obj.item()
    raise TypeError(f"objects of type {type(obj).__name__} are not JSON-like values")


def _ext_hook(code: int, data: memoryview) -> int:
    if code != _BIG_INT:
        raise ValueError(f"unknown MessagePack extension type {code}")
    return int(bytes(data).decode("ascii"))


def _big_ints(value: Any) -> Any:
    """`value` with each int that MessagePack cannot hold as a `_BIG_INT` extension (a rare, slower path)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return msgspec.msgpack.Ext(_BIG_INT, str(value).encode())
    if isinstance(value, dict):
        return {k: _big_ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_big_ints(v) for v in value]
    return value


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(_Body, ext_hook=_ext_hook)


def encode_rollout(groups: list[list[dict]], extra: dict[str, Any] | None = None) -> bytes:
    """Groups of sample dicts (`Sample.to_dict()`) and a JSON-like `extra` dict -> bytes."""
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(s, dict) for s in g)
                                               for g in groups):
        raise SampleCodecError("a rollout is a list of groups, each a list of sample dicts (Sample.to_dict())")
    if extra is not None and not isinstance(extra, dict):
        raise SampleCodecError(f"a rollout's extra state is a dict, got {type(extra).__name__}")
    wire = _pack_tensors([s for g in groups for s in g])  # copies of the samples with tensors: callers' dicts stay
    if wire:
        groups = [[wire.get(id(s), s) for s in g] for g in groups]
    table = {"groups": groups, "extra": extra or {}}
    try:
        try:
            body = _ENCODER.encode(table)
        except OverflowError:
            body = _ENCODER.encode(_big_ints(table))
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # an object, a too large key, a cycle
        raise SampleCodecError(f"a rollout must hold JSON values: {e}") from e
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), zlib.crc32(body)) + body


def json_ready(sample: dict) -> dict:
    """A sample dict whose tensor fields are nested lists: what `json.dumps` takes (saved rollouts, state)."""
    out = dict(sample)
    for name in TENSOR_FIELDS:
        if isinstance(out.get(name), np.ndarray):
            out[name] = out[name].tolist()
    return out


def _pack_tensors(samples: list[dict]) -> dict[int, dict]:
    """{id(sample): a copy of the sample with each tensor field as {dtype, shape, data}} for the samples that have
    one; a field's dtype is the narrowest that holds all of the rollout's values (as versions 1 and 2 did)."""
    wire: dict[int, dict] = {}
    for name in TENSOR_FIELDS:
        try:
            values = {id(s): (s, np.asarray(s[name])) for s in samples if s.get(name) is not None}
        except (TypeError, ValueError) as e:  # ragged nested lists
            raise SampleCodecError(f"field {name!r} must hold rectangular integer arrays: {e}") from e
        filled = [v for _, v in values.values() if v.size]
        bad = next((v for v in filled if v.dtype.kind not in "iu"), None)
        if bad is not None:
            raise SampleCodecError(f"field {name!r} must hold integers, got an array of {bad.dtype}")
        lo = min((int(v.min()) for v in filled), default=0)
        hi = max((int(v.max()) for v in filled), default=0)
        dtype = next(d for d in _TENSOR_DTYPES if np.iinfo(np.dtype(d)).min <= lo and hi <= np.iinfo(np.dtype(d)).max)
        for key, (s, v) in values.items():
            wire.setdefault(key, dict(s))[name] = {
                "dtype": dtype, "shape": list(v.shape), "data": np.ascontiguousarray(v, dtype=dtype).tobytes()}
    return wire


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
    groups, extra = (_read_body if version >= 3 else _read_v2_body)(body, header_len)
    check = check_sample_values if version >= 3 else check_sample_dict  # v3: msgspec checked the types
    for i, sample in enumerate(s for g in groups for s in g):
        try:
            _tensors_from_wire(sample, version)
            check(sample, vocab_size)
            number_versions(sample)
        except InvalidSampleError as e:
            raise SampleCodecError(f"rollout sample {i} (index {sample.get('index')!r}) is invalid: {e}",
                                   field=e.field, sample_index=i) from e
    return groups, extra


def _read_body(body: memoryview, body_len: int) -> tuple[list[list[dict]], dict]:
    if body_len != len(body):
        raise SampleCodecError(f"rollout body length {body_len} does not match the payload ({len(body)} bytes)")
    try:
        decoded = _DECODER.decode(body)
    except msgspec.ValidationError as e:
        raise _sample_error(e, body) from e
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError) as e:
        raise SampleCodecError(f"rollout body is not valid: {e}") from e
    return [[msgspec.structs.asdict(s) for s in g] for g in decoded.groups], decoded.extra


def _sample_error(error: msgspec.ValidationError, body: memoryview) -> SampleCodecError:
    """msgspec's type error as the codec's: naming the sample (its place in the rollout, its index) and the field
    when the error is inside one sample; the structure's error as it is otherwise."""
    where, message = _WHERE.search(str(error)), str(error)
    unknown = re.search(r"unknown field `(\w+)`", message)
    field = where and where.group(3) or (unknown and unknown.group(1))
    if where is None or field is None:
        return SampleCodecError(f"rollout body is not valid: {message}")
    group, position = int(where.group(1)), int(where.group(2))
    try:  # untyped, for the sample's place in the rollout and its index: bytes past the error may not decode
        raw = msgspec.msgpack.decode(body, ext_hook=_ext_hook)["groups"]
        i, index = sum(len(g) for g in raw[:group]) + position, raw[group][position].get("index")
    except (msgspec.DecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return SampleCodecError(f"rollout body is not valid: {message}")
    got = re.search(r"got `(\w+)`", message)
    if unknown:
        what = f"not a field of Sample ({', '.join(WireSample.__struct_fields__)})"
    else:
        what = f"expected {_WIRE_TYPES.get(field, 'a valid value')}, got {got.group(1) if got else '?'} ({message})"
    return SampleCodecError(f"rollout sample {i} (index {index!r}) is invalid: field {field!r}: {what}",
                            field=field, sample_index=i)



def _tensors_from_wire(sample: dict, version: int) -> None:
    """Each tensor field's {dtype, shape, data} -> a numpy array, in place; InvalidSampleError names what is wrong."""
    for name in TENSOR_FIELDS:
        spec = sample.get(name)
        if spec is None or (version < 3 and isinstance(spec, np.ndarray)):  # v1/v2: the arrays were read already
            continue
        if not (version >= 3 and isinstance(spec, dict) and spec.keys() == _TENSOR_KEYS):
            raise InvalidSampleError(name, f"expected an integer array (on the wire a map of {sorted(_TENSOR_KEYS)}), "
                                           f"got {type(spec).__name__}")
        dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
        if not (isinstance(dtype, str) and dtype in _TENSOR_DTYPES):
            raise InvalidSampleError(name, f"dtype {dtype!r} is not one of {_TENSOR_DTYPES}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise InvalidSampleError(name, f"bad shape {shape!r}")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
            size = len(data) if isinstance(data, bytes) else type(data).__name__
            raise InvalidSampleError(name, f"data ({size}) is not {math.prod(shape)} values of {dtype}")
        sample[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # writable, owns its memory


# ---- versions 1 and 2: read only ------------------------------------------------------------------------------------

def _read_v2_body(body: memoryview, header_len: int) -> tuple[list[list[dict]], dict]:
    """A version-1 or -2 body (CRC already checked) -> (groups, extra), tensors as numpy arrays."""
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
        offset = _unpack_arrays_v2(body, header_len, samples, arrays)
        offset = _unpack_tensors_v2(body, offset, samples, tensors)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        if isinstance(e, SampleCodecError):
            raise
        raise SampleCodecError(f"rollout array table is not valid: {e!r}") from e
    if offset != len(body):
        raise SampleCodecError(f"rollout payload has {len(body) - offset} unexpected trailing bytes")
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


def _unpack_arrays_v2(body: memoryview, offset: int, samples: list[dict], arrays: dict) -> int:
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


def _unpack_tensors_v2(body: memoryview, offset: int, samples: list[dict], tensors: dict) -> int:
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
