"""Rollout transports: straw on a temporary directory (durability, restart, trim) and Ray's object store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.config.rollout import DataBufferConfig
from vime.data.sample import Sample
from vime.data.sample_codec import SampleCodecError
from vime.transport.rollouts import make_transport
from vime.transport.rollouts.straw_store import StrawTransport

REPO = Path(__file__).resolve().parents[2]


def _groups(rollout_id: int, n: int = 3) -> list[list[dict]]:
    return [[Sample(group_index=g, index=rollout_id * 10 + g * n + i, tokens=[1, 2, 3, rollout_id], response_length=1,
                    loss_mask=[1], rollout_log_probs=[-0.25 * i], reward=float(i)).to_dict() for i in range(n)]
            for g in range(2)]


def _pack_files(root: Path) -> list[Path]:
    return sorted((root / "straw").rglob("*.pack"))


def test_straw_round_trip_and_a_second_process_instance_reads_it(tmp_path):
    writer, reader = StrawTransport(tmp_path), StrawTransport(tmp_path)
    handle = writer.put(3, _groups(3), {"data_source": {"offset": 5}, "rollout_id": 3})
    groups, extra = reader.get(handle)
    assert groups == _groups(3) and extra == {"data_source": {"offset": 5}, "rollout_id": 3}
    assert reader.stored() == {3: handle}
    writer.close(), reader.close()


def test_straw_put_is_durable_when_it_returns_even_if_the_writer_is_sigkilled(tmp_path):
    code = (f"import os, sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from vime.transport.rollouts.straw_store import StrawTransport\n"
            f"from tests.unit.test_transport import _groups\n"
            f"t = StrawTransport({str(tmp_path)!r})\n"
            "for i in range(3): t.put(i, _groups(i), {'i': i})\n"
            "os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    restarted = StrawTransport(tmp_path)
    stored = restarted.stored()
    assert sorted(stored) == [0, 1, 2]
    for i, handle in stored.items():
        assert restarted.get(handle) == (_groups(i), {"i": i})


def test_trim_forgets_rollouts_and_reclaims_their_packs(tmp_path):
    t = StrawTransport(tmp_path)
    for i in range(4):
        t.put(i, _groups(i), {})
    assert len(_pack_files(tmp_path)) == 4
    t.trim([0, 1])
    assert sorted(t.stored()) == [2, 3]
    assert len(_pack_files(tmp_path)) == 2
    assert StrawTransport(tmp_path).get(t.stored()[3])[0] == _groups(3)  # the rest is intact


def test_straw_read_of_a_damaged_pack_names_the_rollout(tmp_path):
    t = StrawTransport(tmp_path)
    handle = t.put(7, _groups(7), {})
    t.close()
    pack = _pack_files(tmp_path)[0]
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="rollout 7 could not be read"):
        StrawTransport(tmp_path).get(handle)


def test_index_is_plain_json(tmp_path):
    StrawTransport(tmp_path).put(12, _groups(12), {})
    entry = json.loads((tmp_path / "index" / "rollout_00000012.json").read_text())
    assert entry["rollout_id"] == 12 and entry["ref"]["records"] == 1
    assert not [p for p in os.listdir(tmp_path / "index") if ".tmp" in p]


def test_make_transport_picks_by_flag(tmp_path):
    assert isinstance(make_transport(DataBufferConfig(rollout_data_transport="straw", rollout_data_dir=str(tmp_path))),
                      StrawTransport)
    with pytest.raises(ValueError, match="object-store or straw"):
        make_transport(DataBufferConfig(rollout_data_transport="carrier-pigeon"))


def test_object_store_round_trip_across_an_actor():
    ray = pytest.importorskip("ray")
    here = os.pathsep.join([str(Path(__file__).parent), str(REPO)])  # workers import this module to build the actor
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": here}})
    try:
        @ray.remote
        class Producer:
            def __init__(self):
                self.transport = make_transport(DataBufferConfig(rollout_data_transport="object-store"))

            def put(self, i):
                return self.transport.put(i, _groups(i), {"rollout_id": i})

        producer = Producer.remote()
        transport = make_transport(DataBufferConfig(rollout_data_transport="object-store"))
        handle = ray.get(producer.put.remote(5))
        assert transport.get(handle) == (_groups(5), {"rollout_id": 5})
        assert transport.stored() == {}
    finally:
        ray.shutdown()


def test_get_checks_token_ids_against_the_readers_vocabulary(tmp_path):
    t = StrawTransport(tmp_path)
    handle = t.put(3, _groups(3), {})  # token ids 1, 2, 3
    assert t.get(handle, vocab_size=4)[0] == _groups(3)
    with pytest.raises(SampleCodecError, match=r"token id 3 is outside the vocabulary \[0, 3\)"):
        t.get(handle, vocab_size=3)
    t.close()
