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
               status=Sample.Status.COMPLETED, metadata={"k": [1, {"x": None}], "uni": "é✓"}, weight_versions=[3])
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
    groups = [[{**Sample(index=0).to_dict(), "loss_mask": [True, False], "tokens": [1, 2], "response_length": 2}]]
    back, _ = decode_rollout(encode_rollout(groups))
    assert back == groups and type(back[0][0]["loss_mask"][0]) is bool


def test_a_float_token_is_carried_but_refused_on_decode():
    groups = [[Sample(index=0).to_dict(), {**Sample(index=9).to_dict(), "tokens": [1, 2.5]}]]
    with pytest.raises(SampleCodecError, match=r"sample 1 \(index 9\).*'tokens'.*integers") as e:
        decode_rollout(encode_rollout(groups))
    assert (e.value.field, e.value.sample_index) == ("tokens", 1)


def _one(**fields) -> bytes:
    """A rollout of a valid sample and a second one with `fields` changed (tokens 1..4, two response tokens)."""
    ok = Sample(index=0, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.0])
    return encode_rollout([[ok.to_dict()], [{**ok.to_dict(), "index": 1, **fields}]])


@pytest.mark.parametrize("fields, field, message", [
    ({"tokens": [1, 2, 3, 50_000]}, "tokens", r"token id 50000 is outside the vocabulary \[0, 32000\)"),
    ({"tokens": [1, -2, 3, 4]}, "tokens", "token id -2"),
    ({"loss_mask": [1]}, "loss_mask", "1 entries for response_length 2"),
    ({"loss_mask": [1, 2]}, "loss_mask", "0 or 1"),
    ({"rollout_log_probs": [-0.5, -1.0, -2.0]}, "rollout_log_probs", "3 entries for response_length 2"),
    ({"rollout_log_probs": [float("nan"), -1.0]}, "rollout_log_probs", "entry 0 .nan. is not a finite"),
    ({"rollout_log_probs": [-0.5, float("-inf")]}, "rollout_log_probs", "entry 1 .-inf. is not a finite"),
    ({"response_length": 5}, "response_length", "5 is not within the 4 tokens"),
    ({"status": "exploded"}, "status", "'exploded' is not one of"),
    ({"reward": "high"}, "reward", "got str"),
])
def test_invalid_samples_are_refused_naming_the_field_and_the_sample(fields, field, message):
    with pytest.raises(SampleCodecError, match=message) as e:
        decode_rollout(_one(**fields), vocab_size=32000)
    assert (e.value.field, e.value.sample_index) == (field, 1)
    assert "rollout sample 1 (index 1)" in str(e.value)


def test_token_ids_are_checked_against_the_vocabulary_only_when_it_is_known():
    data = _one(tokens=[1, 2, 3, 31999])
    assert decode_rollout(data, vocab_size=32000)[0][1][0]["tokens"][-1] == 31999  # the last id is in
    with pytest.raises(SampleCodecError, match="token id 31999"):
        decode_rollout(data, vocab_size=31999)
    assert decode_rollout(_one(tokens=[1, 2, 3, 2**40]))[0][1][0]["tokens"][-1] == 2**40  # no vocabulary: any id


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
