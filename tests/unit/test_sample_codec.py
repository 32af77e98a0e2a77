"""The rollout codec: exact round trips (floats bit for bit), no pickle, clear errors on foreign or damaged bytes;
rollouts stored in format versions 1 and 2 (before the MessagePack body of version 3) still load."""

from __future__ import annotations

import ast
import math
import pickle
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tests.helpers.legacy_rollout import encode_v1_v2
from vime.data import sample_codec
from vime.data.sample import Sample
from vime.data.sample_codec import FORMAT_VERSION, MAGIC, SampleCodecError, decode_rollout, encode_rollout

DATA = Path(__file__).parent / "data"
EXTRA = {"data_source": {"epoch": 1, "offset": 3, "buffer": []}, "rollout_id": 7}


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


def test_numeric_fields_are_binary_not_text():
    tokens = list(range(1000, 3000))
    data = encode_rollout([[Sample(index=0, tokens=tokens, response_length=10).to_dict()]])
    assert str(tokens[500]).encode() not in data  # not written out as JSON text
    assert len(data) < 2000 * 4 + 1000  # at most 5 bytes a token id below 2**32, not 5-6 characters


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
    """A valid CRC over a version-1 header that promises more array bytes than exist (a writer bug, not bit rot)."""
    data = encode_v1_v2(_groups())
    header_len = struct.unpack_from("<I", data, 12)[0]
    body = data[20:20 + header_len] + data[20 + header_len:-4]  # drop the last 4 array bytes
    forged = struct.pack("<8sHHII", MAGIC, 1, 0, header_len, zlib.crc32(body)) + body
    with pytest.raises(SampleCodecError, match="needs .* bytes"):
        decode_rollout(forged)


def test_values_json_cannot_hold_are_refused_on_encode():
    with pytest.raises(SampleCodecError, match="JSON"):
        encode_rollout([[{**Sample(index=0).to_dict(), "metadata": {"obj": object()}}]])


# ---- version 3: MessagePack body -------------------------------------------------------------------------------

def _with_routing() -> list[list[dict]]:
    """_groups() and a group with routed experts: a uint8 array, a wider one, nested lists and None."""
    routing = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    wide = [[[299, 0]], [[7, 1]]]  # nested lists (a JSON-loaded sample), ids past uint8
    tensors = [Sample(group_index=2, index=3 + i, tokens=list(range(5)), response_length=1, loss_mask=None,
                      rollout_log_probs=[-0.0], rollout_routed_experts=r).to_dict()
               for i, r in enumerate((routing, wide, None))]
    return _groups() + [tensors]


def _rewrap(body: bytes, version: int = FORMAT_VERSION) -> bytes:
    return struct.pack("<8sHHII", MAGIC, version, 0, len(body), zlib.crc32(body)) + body


def test_v3_round_trip_with_tensors_none_fields_big_ints_and_extra():
    groups = _with_routing()
    groups[0][0]["metadata"]["big"] = [2**64, -2**63 - 1, 10**30]  # past msgpack's ints: JSON carried them
    groups[0][1]["tokens"] = [np.int64(5), np.uint32(2**40 % 2**32)]  # numpy scalars, as taken from an array
    extra = {**EXTRA, "nested": {"x": [None, 1.5, "é"], "big": 2**70}}
    data = encode_rollout(groups, extra)
    magic, version, _, body_len, crc = struct.unpack_from("<8sHHII", data)
    assert (magic, version, body_len, crc) == (MAGIC, 3, len(data) - 20, zlib.crc32(data[20:]))
    back, back_extra = decode_rollout(data)
    assert back_extra == extra and back[0][0]["metadata"]["big"] == [2**64, -2**63 - 1, 10**30]
    assert back[0][1]["tokens"] == [5, 2**40 % 2**32] and all(type(t) is int for t in back[0][1]["tokens"])
    first, wide, none = back[2]
    assert first["rollout_routed_experts"].dtype == wide["rollout_routed_experts"].dtype == np.uint16  # rollout-wide
    assert np.array_equal(first["rollout_routed_experts"], np.arange(24).reshape(4, 3, 2))
    assert wide["rollout_routed_experts"].tolist() == [[[299, 0]], [[7, 1]]] and none["rollout_routed_experts"] is None
    assert first["rollout_routed_experts"].flags.writeable and first["loss_mask"] is None
    assert struct.pack("<d", first["rollout_log_probs"][0]) == struct.pack("<d", -0.0)  # the sign bit too
    assert back[0][0]["rollout_log_probs"][1] == -1e-300 and back[0][1]["rollout_log_probs"] == [
        math.nextafter(-2.5, 0.0)]
    rest = {k: v for k, v in first.items() if k != "rollout_routed_experts"}
    assert rest == {k: v for k, v in _with_routing()[2][0].items() if k != "rollout_routed_experts"}
    assert isinstance(groups[2][0]["rollout_routed_experts"], np.ndarray)  # the caller's dicts are untouched


def test_v1_and_v2_payloads_of_earlier_runs_still_decode():
    v1, v2 = (DATA / "rollout_v1.bin").read_bytes(), (DATA / "rollout_v2.bin").read_bytes()
    routing = np.arange(12, dtype=np.uint16).reshape(2, 3, 2) * 100
    with_tensor = _groups() + [[Sample(group_index=2, index=3, tokens=[1, 2, 3], rollout_routed_experts=routing)
                                .to_dict()]]
    assert (v1[8], v2[8]) == (1, 2)
    assert encode_v1_v2(_groups(), EXTRA) == v1 and encode_v1_v2(with_tensor, EXTRA) == v2  # the helper is faithful
    assert decode_rollout(v1) == (_groups(), EXTRA)
    back, extra = decode_rollout(v2)
    assert extra == EXTRA and back[:2] == _groups()
    got = back[2][0]["rollout_routed_experts"]
    assert got.dtype == np.uint16 and np.array_equal(got, routing)
    with pytest.raises(SampleCodecError, match=r"sample 1 \(index 1\).*token id 1099511627776") as e:
        decode_rollout(v1, vocab_size=100)  # the Sample contract holds for old payloads too
    assert (e.value.field, e.value.sample_index) == ("tokens", 1)


@pytest.mark.parametrize("name", ["rollout_v1.bin", "rollout_v2.bin", None])
@pytest.mark.parametrize("damage", [lambda d: d[:-1], lambda d: d[:len(d) // 2],
                                    lambda d: d[:-5] + bytes([d[-5] ^ 0x10]) + d[-4:],
                                    lambda d: d[:25] + bytes([d[25] ^ 1]) + d[26:]])
def test_flipped_or_truncated_payloads_of_every_version_are_refused(name, damage):
    data = (DATA / name).read_bytes() if name else encode_rollout(_with_routing(), EXTRA)
    with pytest.raises(SampleCodecError, match="CRC32"):
        decode_rollout(damage(data))


_SAMPLE = Sample(index=0, tokens=[1, 2]).to_dict()
_TENSOR = {"dtype": "|u1", "shape": [2, 1, 2], "data": b"\x00\x01\x02\x03"}


@pytest.mark.parametrize("body, message", [
    ([1, 2], r"rollout body is not valid: Expected `object`, got `array`"),
    ({"groups": 1, "extra": {}}, r"Expected `array`, got `int` - at `\$.groups`"),
    ({"groups": [[_SAMPLE, 5]], "extra": {}}, r"Expected `object`, got `int` - at `\$.groups\[0\]\[1\]`"),
    ({"groups": [[_SAMPLE]]}, "missing required field `extra`"),
    ({"groups": [], "extra": {}, "arrays": {}}, "unknown field `arrays`"),
    ({"groups": [], "extra": []}, r"Expected `object`, got `array` - at `\$.extra`"),
    ({"groups": [], "extra": {"x": msgspec.msgpack.Ext(9, b"")}}, "unknown MessagePack extension type 9"),
    ({"groups": [], "extra": {"x": msgspec.msgpack.Ext(1, b"12a")}}, "invalid literal"),
])
def test_structurally_wrong_bodies_are_refused(body, message):
    with pytest.raises(SampleCodecError, match=message) as e:
        decode_rollout(_rewrap(msgspec.msgpack.encode(body)))
    assert (e.value.field, e.value.sample_index) == (None, None)


@pytest.mark.parametrize("tensor, message", [
    ([[[1, 2]]], "expected an integer array \\(on the wire a map of \\['data', 'dtype', 'shape'\\]\\), got list"),
    ({**_TENSOR, "extra": 1}, "on the wire a map of .*got dict"),
    ({**_TENSOR, "dtype": "<f8"}, "dtype '<f8' is not one of"),
    ({**_TENSOR, "dtype": "O"}, "dtype 'O' is not one of"),
    ({**_TENSOR, "shape": [2, -1]}, r"bad shape \[2, -1\]"),
    ({**_TENSOR, "shape": [True, 4]}, r"bad shape \[True, 4\]"),
    ({**_TENSOR, "shape": 4}, "bad shape 4"),
    ({**_TENSOR, "data": b"\x00\x01\x02"}, r"data \(3\) is not 4 values of \|u1"),
    ({**_TENSOR, "shape": [2**40, 2**40]}, "is not 1208925819614629174706176 values"),
    ({**_TENSOR, "data": "0123"}, r"data \(str\)"),
])
def test_a_wrong_tensor_map_names_the_field_and_the_sample(tensor, message):
    groups = [[_SAMPLE, {**_SAMPLE, "index": 4, "rollout_routed_experts": tensor}]]
    with pytest.raises(SampleCodecError, match=message) as e:
        decode_rollout(_rewrap(msgspec.msgpack.encode({"groups": groups, "extra": {}})))
    assert (e.value.field, e.value.sample_index) == ("rollout_routed_experts", 1)
    assert "rollout sample 1 (index 4) is invalid" in str(e.value)


def test_a_v1_header_with_a_tensor_left_in_its_json_is_refused():
    """Version-2 writers always packed the tensors: one left in a sample's JSON is not from a vime writer."""
    data = encode_v1_v2([[_SAMPLE, _SAMPLE]])
    header_len = struct.unpack_from("<I", data, 12)[0]
    header = data[20:20 + header_len].replace(b'"rollout_routed_experts":null}]]', b'"rollout_routed_experts":[[1]]}]]')
    body = header + data[20 + header_len:]
    with pytest.raises(SampleCodecError, match="expected an integer array") as e:
        decode_rollout(struct.pack("<8sHHII", MAGIC, 1, 0, len(header), zlib.crc32(body)) + body)
    assert (e.value.field, e.value.sample_index) == ("rollout_routed_experts", 1)


def test_a_body_length_that_disagrees_with_the_payload_is_refused():
    data = bytearray(encode_rollout(_groups()))
    struct.pack_into("<I", data, 12, len(data) - 20 + 1)
    with pytest.raises(SampleCodecError, match="body length .* does not match"):
        decode_rollout(bytes(data))


def test_trailing_bytes_after_the_body_are_refused():
    with pytest.raises(SampleCodecError, match="trailing characters"):
        decode_rollout(_rewrap(encode_rollout(_groups())[20:] + b"\xc0"))


def test_nothing_is_ever_unpickled(monkeypatch):
    """The codec imports no pickle and never loads with numpy's allow_pickle; decoding every version with pickle
    disabled works, and a pickle under a valid prefix and CRC is refused, not run."""
    tree = ast.parse(Path(sample_codec.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not imported & {"pickle", "cloudpickle", "dill", "marshal", "shelve"}
    assert "allow_pickle" not in Path(sample_codec.__file__).read_text()
    payloads = [(DATA / "rollout_v1.bin").read_bytes(), (DATA / "rollout_v2.bin").read_bytes(),
                encode_rollout(_with_routing(), EXTRA)]

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for data in payloads:
        decode_rollout(data)

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))

    with pytest.raises(SampleCodecError, match="rollout body is not valid"):
        decode_rollout(_rewrap(pickle.dumps(Boom())))
    with pytest.raises(SampleCodecError, match="rollout header is not valid"):
        decode_rollout(_rewrap(pickle.dumps(Boom()), version=1))


def test_the_wire_schema_is_the_sample_and_labels_become_versions():
    """`WireSample` declares exactly `Sample`'s fields with its defaults; an unknown field is refused naming it and
    the sample; weight-version labels an earlier writer stored as strings decode as ints."""
    import dataclasses

    assert sample_codec.WireSample.__struct_fields__ == tuple(f.name for f in dataclasses.fields(Sample))
    assert msgspec.structs.asdict(sample_codec.WireSample()) == {**Sample().to_dict(), "status": "pending"}
    with pytest.raises(SampleCodecError, match=r"rollout sample 1 \(index 1\) is invalid: field 'score': not a field"
                       ) as e:
        decode_rollout(_one(score=1.0))
    assert (e.value.field, e.value.sample_index) == ("score", 1)
    labels = {"weight_versions": ["default", "3"], "weight_version_spans": [["default", 0, 1], ["3", 1, 2]]}
    back = decode_rollout(_one(**labels))[0][1][0]
    assert back["weight_versions"] == [0, 3] and back["weight_version_spans"] == [[0, 0, 1], [3, 1, 2]]
