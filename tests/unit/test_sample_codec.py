"""The rollout codec: exact round trips (floats bit for bit), no pickle, clear errors on foreign or damaged bytes."""

from __future__ import annotations

import math
import struct
import zlib

import pytest

from vime.data.sample_codec import FORMAT_VERSION, MAGIC, SampleCodecError, decode_rollout, encode_rollout
from vime.utils.types import Sample


def _groups() -> list[list[dict]]:
    a = Sample(group_index=0, index=0, prompt="1+1=", tokens=[5, 6, 7, 8, 9], response="2", response_length=2,
               label="2", reward=1.0, loss_mask=[1, 0], rollout_log_probs=[-0.1, -1e-300],
               status=Sample.Status.COMPLETED, metadata={"k": [1, {"x": None}], "uni": "é✓"}, weight_versions=["3"])
    b = Sample(group_index=0, index=1, prompt=[{"role": "user", "content": "hi"}], tokens=[5, 2**40],
               response_length=1, reward={"acc": 0.0, "fmt": 1}, loss_mask=None,
               rollout_log_probs=[math.nextafter(-2.5, 0.0)], status=Sample.Status.TRUNCATED,
               tools=[{"name": "calc"}])
    c = Sample(group_index=1, index=2, tokens=[], loss_mask=[], rollout_log_probs=[])  # empty lists stay lists
    return [[a.to_dict(), b.to_dict()], [c.to_dict()]]


def test_round_trip_is_exact_and_samples_rebuild():
    groups = _groups()
    extra = {"data_source": {"epoch": 1, "offset": 3, "buffer": []}, "rollout_id": 7}
    data = encode_rollout(groups, extra)
    assert data[:8] == MAGIC and b"pickle" not in data
    back, back_extra = decode_rollout(data)
    assert back == groups and back_extra == extra
    lp = back[0][1]["rollout_log_probs"][0]
    assert struct.pack("<d", lp) == struct.pack("<d", math.nextafter(-2.5, 0.0))  # bit-exact
    assert back[0][0]["rollout_log_probs"][1] == -1e-300
    assert back[0][1]["tokens"][1] == 2**40  # beyond int32: stored as int64
    assert [[Sample.from_dict(d) for d in g] for g in back][0][0].status is Sample.Status.COMPLETED
    assert groups == _groups()  # encoding did not touch the caller's dicts


def test_numeric_fields_are_packed_binary_not_json():
    tokens = list(range(1000, 3000))
    data = encode_rollout([[Sample(index=0, tokens=tokens, response_length=10).to_dict()]])
    assert str(tokens[500]).encode() not in data  # not written out as JSON text
    assert len(data) < 2000 * 4 + 1000  # int32, not 5-6 characters a token


def test_non_numeric_values_in_a_packed_field_fall_back_to_json():
    groups = [[{**Sample(index=0).to_dict(), "loss_mask": [True, False], "tokens": [1, 2.5]}]]
    back, _ = decode_rollout(encode_rollout(groups))
    assert back == groups and type(back[0][0]["loss_mask"][0]) is bool and back[0][0]["tokens"] == [1, 2.5]


def test_unknown_version_is_named():
    data = bytearray(encode_rollout(_groups()))
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    with pytest.raises(SampleCodecError, match=f"version {FORMAT_VERSION + 1}"):
        decode_rollout(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-3], "CRC32"),
    (lambda d: d[:10], "too short"),
    (lambda d: b"PICKLE!!" + d[8:], "not a vime rollout"),
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "CRC32"),
])
def test_corrupt_bytes_raise_a_clear_error(damage, message):
    with pytest.raises(SampleCodecError, match=message):
        decode_rollout(damage(encode_rollout(_groups())))


def test_a_consistent_but_wrong_array_table_is_refused():
    """A valid CRC over a header that promises more array bytes than exist (a writer bug, not bit rot)."""
    data = encode_rollout(_groups())
    header_len = struct.unpack_from("<I", data, 12)[0]
    body = data[20:20 + header_len] + data[20 + header_len:-4]  # drop the last 4 array bytes
    forged = struct.pack("<8sHHII", MAGIC, FORMAT_VERSION, 0, header_len, zlib.crc32(body)) + body
    with pytest.raises(SampleCodecError, match="needs .* bytes"):
        decode_rollout(forged)


def test_values_json_cannot_hold_are_refused_on_encode():
    with pytest.raises(SampleCodecError, match="JSON"):
        encode_rollout([[{**Sample(index=0).to_dict(), "metadata": {"obj": object()}}]])
