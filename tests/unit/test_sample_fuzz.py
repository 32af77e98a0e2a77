"""Fuzzing the rollout codec and `Sample.from_dict`: whatever they are given, they return a valid sample or raise
their own error (SampleCodecError, InvalidSampleError), never a KeyError / TypeError / numpy error from inside.

Damaged bytes get a recomputed CRC32 so that they reach the decoder's checks instead of stopping at the checksum.
Rollouts in format versions 1 and 2 (what earlier runs stored; `tests/helpers/legacy_rollout.py` writes them) are
fuzzed like those of the current version 3.
"""

from __future__ import annotations

import json
import math
import struct
import zlib

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.legacy_rollout import encode_v1_v2
from vime.data.sample import InvalidSampleError, Sample, check_sample_dict
from vime.data.sample_codec import SampleCodecError, decode_rollout, encode_rollout

FUZZ = settings(max_examples=150, deadline=2000, database=None, suppress_health_check=[HealthCheck.too_slow])
PREFIX = struct.Struct("<8sHHII")  # the codec's: magic, version, reserved, header (v3: body) length, body crc32
VOCAB = 1000

# numbers and JSON values, including the ones a sample must not hold (NaN, inf, bools, huge and negative ints)
numbers = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
json_values = st.recursive(st.none() | numbers | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=4),
                           max_leaves=12)
# what a MessagePack body holds: ints within 64 bits, and bytes (a tensor's data)
wire_values = st.recursive(st.none() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.booleans()
                           | st.text(max_size=5) | st.binary(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=4),
                           max_leaves=12)


@st.composite
def valid_samples(draw) -> dict:
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
    n = draw(st.integers(0, len(tokens)))
    log_probs = st.floats(-50, 0, allow_nan=False)
    routing = draw(st.none() | st.lists(st.lists(st.integers(0, 300), min_size=2, max_size=2), max_size=3))
    return Sample(index=draw(st.integers(0, 10**6)), tokens=tokens, response_length=n,
                  loss_mask=draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n)),
                  rollout_log_probs=draw(st.none() | st.lists(log_probs, min_size=n, max_size=n)),
                  reward=draw(st.none() | st.floats(-1, 1)), status=draw(st.sampled_from(Sample.Status)),
                  metadata=draw(st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)),
                  rollout_routed_experts=None if routing is None else np.array(routing, dtype=np.int64).reshape(
                      -1, 1, 2)).to_dict()


rollouts = st.lists(st.lists(valid_samples(), min_size=1, max_size=3), min_size=1, max_size=3)


def _with_crc(body: bytes, version: int, header_len: int) -> bytes:
    return PREFIX.pack(b"VIMEROLL", version, 0, header_len, zlib.crc32(body)) + body


def _decode_or_codec_error(data: bytes) -> None:
    """The property: decoding returns only valid samples, or raises SampleCodecError (anything else fails)."""
    try:
        groups, extra = decode_rollout(data, vocab_size=VOCAB)
    except SampleCodecError:
        return
    assert isinstance(extra, dict)
    for sample in (s for g in groups for s in g):
        check_sample_dict(sample, vocab_size=VOCAB)
        routing = sample.get("rollout_routed_experts")
        assert routing is None or (isinstance(routing, np.ndarray) and routing.dtype.kind in "iu")


@pytest.mark.parametrize("encode", [encode_rollout, encode_v1_v2], ids=["v3", "v1-v2"])
@FUZZ
@given(rollouts, st.lists(st.tuples(st.integers(0, 2**32), st.integers(0, 255), st.sampled_from("sid")),
                          min_size=1, max_size=4))
def test_mutated_bytes_with_a_valid_crc_raise_only_codec_errors(encode, groups, edits):
    data = encode(groups, {"rollout_id": 1})
    _, version, _, header_len, _ = PREFIX.unpack_from(data)
    body = bytearray(data[PREFIX.size:])
    for pos, byte, kind in edits:  # (s)et, (i)nsert or (d)elete one byte
        pos %= len(body) + 1
        if kind == "s" and pos < len(body):
            body[pos] = byte
        elif kind == "i":
            body.insert(pos, byte)
        elif kind == "d" and pos < len(body):
            del body[pos]
    _decode_or_codec_error(_with_crc(bytes(body), version, header_len))


def _paths(value, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _rewrite_one_value(table, data, values) -> None:
    """Replace one value of a decoded table (a sample field, a length, a dtype, a shape, ...) with one of `values`."""
    path, _ = data.draw(st.sampled_from(list(_paths(table))[1:]))
    target = table
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(values)


@FUZZ
@given(rollouts, st.data())
def test_rewritten_bodies_with_a_valid_crc_raise_only_codec_errors(groups, data):
    """Version 3: rewrite one value of the MessagePack body; this reaches the structure, tensor-map and sample
    checks that byte flips mostly stop short of."""
    body = msgspec.msgpack.decode(encode_rollout(groups, {"rollout_id": 1})[PREFIX.size:])  # big ints stay Ext
    _rewrite_one_value(body, data, wire_values)
    new_body = msgspec.msgpack.encode(body)
    _decode_or_codec_error(_with_crc(new_body, 3, len(new_body)))


@FUZZ
@given(rollouts, st.data())
def test_rewritten_legacy_headers_with_a_valid_crc_raise_only_codec_errors(groups, data):
    """Versions 1 and 2: rewrite one value of the JSON header: this reaches the array-table and sample checks."""
    encoded = encode_v1_v2(groups, {"rollout_id": 1})
    _, version, _, header_len, _ = PREFIX.unpack_from(encoded)
    header = json.loads(encoded[PREFIX.size:PREFIX.size + header_len])
    arrays = encoded[PREFIX.size + header_len:]
    _rewrite_one_value(header, data, json_values)
    new_header = json.dumps(header).encode()
    _decode_or_codec_error(_with_crc(new_header + arrays, version, len(new_header)))


field_values = st.fixed_dictionaries({}, optional={
    name: json_values for name in ("group_index", "index", "prompt", "tokens", "response", "response_length",
                                   "label", "reward", "loss_mask", "rollout_log_probs", "status", "metadata",
                                   "weight_versions", "tools", "rollout_routed_experts")})
sample_like = st.one_of(
    valid_samples(),
    field_values,
    st.builds(lambda s, name, value: {**s, name: value}, valid_samples(),  # one field of a valid sample changed
              st.sampled_from(["tokens", "response_length", "loss_mask", "rollout_log_probs", "status", "index"]),
              json_values | st.lists(numbers, max_size=12)),
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),  # unknown fields
    json_values,  # not even a dict
)


@FUZZ
@given(sample_like)
def test_sample_from_dict_returns_a_valid_sample_or_raises_invalid_sample(d):
    try:
        sample = Sample.from_dict(d)
    except InvalidSampleError:
        return
    assert 0 <= sample.response_length <= len(sample.tokens)
    for per_token in (sample.loss_mask, sample.rollout_log_probs):
        assert per_token is None or len(per_token) == sample.response_length
    assert all(math.isfinite(x) for x in sample.rollout_log_probs or [])
    assert all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sample.tokens)


@FUZZ
@given(st.lists(st.lists(sample_like, max_size=3), max_size=3) | json_values)
def test_encoding_anything_raises_only_codec_errors_and_decoding_it_checks_it(groups):
    try:
        data = encode_rollout(groups, {})
    except SampleCodecError:
        return
    _decode_or_codec_error(data)


def test_a_null_log_prob_or_mask_entry_is_named():
    """Found by the fuzz test above: a None entry slipped past the type check (it was next(..., None)'s default)
    and surfaced as a TypeError from math.isfinite instead of the field's codec error."""
    d = Sample(index=0, tokens=[5, 6, 7], response_length=2, rollout_log_probs=[-0.5, -1.0], loss_mask=[1, 1],
               status=Sample.Status.COMPLETED).to_dict()
    for field, value in (("rollout_log_probs", [-0.5, None]), ("loss_mask", [None, 1])):
        with pytest.raises(InvalidSampleError, match=field):
            check_sample_dict({**d, field: value})
