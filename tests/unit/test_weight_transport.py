"""Weight transports without an engine: the wire protocol and the bookkeeping (buckets, multi-sender broadcast
for pipeline stages, delta's layer grouping), the engine command and the weight check's tolerances; and the
driver's side of an update (`WeightSync`) against the real Megatron trainer in this process, with Ray's `.remote`
/ `get` / `wait` stand-ins running calls on threads (`tests.helpers.weight_sync_driver`): send and apply run
together for a collective, staging overlaps a rollout, fault tolerance leaves a recovery copy. With a real vLLM
engine: test_weight_transport_engine.py.
"""

from __future__ import annotations

import argparse
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.weight_sync_driver import ARGV, EXTENSION, driver, fake_ray, update_weights  # noqa: F401

pytest.importorskip("megatron.core")

from vime.transport.weights.base import DriverSetup, WeightTransport  # noqa: E402
from vime.transport.weights.broadcast.driver import engine_set_key  # noqa: E402
from vime.transport.weights.check import (FLOAT32_TOLERANCE, WeightUpdateMismatchError,  # noqa: E402
                                                  compare_log_probs, tolerance_for)
from vime.engine.protocol.weight_broadcast import broadcast_weights, join_group, plan_buckets  # noqa: E402
from vime.transport.weights.delta.rank import changed_tensors, load_unit  # noqa: E402
from vime.transport.weights.disk.driver import DiskDriver  # noqa: E402
from vime.transport.weights.disk.rank import tensor_bytes, write_stage_file  # noqa: E402
from vime.utils.misc import find_free_port  # noqa: E402


# ---- no engine -----------------------------------------------------------------------------------------------
def test_buckets_respect_the_size_and_alignment():
    meta = [["a", "torch.float32", [10]], ["b", "torch.bfloat16", [3]], ["big", "torch.float32", [100]],
            ["c", "torch.int64", [2, 2]], ["d", "torch.float32", [4]], ["e", "torch.float32", [20]],
            ["huge", "torch.float32", [2**18]], ["f", "torch.float32", [1]]]
    buckets = plan_buckets(meta, bucket_bytes=128)
    assert [[e[0] for e in entries] for entries, _ in buckets] == [["a", "b"], ["big"], ["c", "d"], ["e"], ["huge"],
                                                                    ["f"]]
    (a, b), total = buckets[0]
    assert a[3] == 0 and b[3] == 64 and total == 64 + 6  # every tensor starts on a 64-byte boundary
    assert buckets[1][1] == 400  # larger than a bucket: travels alone
    # With roomy buckets, small tensors share one and a tensor of 1 MiB or more still travels alone, in order.
    buckets = plan_buckets(meta, bucket_bytes=512 * 2**20)
    assert [[e[0] for e in entries] for entries, _ in buckets] == [["a", "b", "big", "c", "d", "e"], ["huge"], ["f"]]


def test_broadcast_protocol_with_two_senders():
    """Pipeline stages 0 and 1 each send their tensors; the receiver gets both, bit for bit, in order."""
    port, key = find_free_port(), "t"
    own = {0: [("w0", torch.randn(5, 7)), ("n0", torch.randn(3).bfloat16())],
           1: [("w1", torch.randn(300)), ("i1", torch.arange(6).view(2, 3))]}
    got = {}

    def member(rank):
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        pg = join_group({}, key, "127.0.0.1", port, rank, 3, "gloo")
        got[rank] = list(broadcast_weights(pg, 2, 1024, "cpu", own=own.get(rank)))
        stateless_destroy_torch_distributed_process_group(pg)

    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(member, r) for r in range(3)]:
            f.result(timeout=60)
    sent = own[0] + own[1]
    assert [n for n, _ in got[2]] == [n for n, _ in sent]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got[2], sent))
    assert [n for n, _ in got[0]] == ["w1", "i1"] and [n for n, _ in got[1]] == ["w0", "n0"]


def test_the_weight_groups_store_listens_on_the_master_address_alone():
    """Rank 0 (the first training writer) serves the group's store on master_addr only, on the socket it reserved
    when it gave out the address; torch's own store would listen on every interface ([::]) for the whole run."""
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    from vime.utils.listeners import hex_address, tcp_sockets
    from vime.utils.rendezvous import reserve_rendezvous

    def listening(port):
        return {local for local, _, state, _, _ in tcp_sockets() if state == "0A" and local.endswith(f":{port:04X}")}

    groups = {}
    joined = threading.Barrier(3)

    def member(host, port, rank):
        groups[rank] = join_group({}, "t", host, port, rank, 3, "gloo")
        joined.wait(timeout=60)

    # a port chosen free, then one reserved as the trainer reserves it
    for host, port in (("127.0.0.1", find_free_port()), reserve_rendezvous("127.0.0.1")):
        with ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(member, host, port, r) for r in range(3)]:
                f.result(timeout=60)
        try:
            assert listening(port) == {hex_address("127.0.0.1", port)}
        finally:
            for pg in groups.values():
                stateless_destroy_torch_distributed_process_group(pg)


def test_delta_sends_whole_vllm_layers():
    assert load_unit("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert load_unit("model.layers.3.self_attn.q_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert load_unit("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert load_unit("model.layers.0.mlp.experts.7.down_proj.weight") == "model.layers.0.mlp.experts"
    assert load_unit("model.norm.weight") == "model.norm"
    weights = [(f"model.layers.0.self_attn.{p}_proj.weight", torch.ones(2)) for p in "qkvo"]
    weights.append(("model.norm.weight", torch.ones(2)))
    names, digests = changed_tensors(weights, {})
    assert names == [n for n, _ in weights]  # nothing known yet: everything
    weights[0] = (weights[0][0], torch.tensor([1.0, 1.0 + 1e-7]))  # q changed by one ulp-ish
    names, _ = changed_tensors(weights, digests)
    assert names == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert changed_tensors(weights, changed_tensors(weights, {})[1])[0] == []


def test_sending_leaves_the_trainers_storages_resizable(tmp_path):
    """Writing (disk) and digesting (delta) a trainer's tensors reads their bytes without numpy, which would pin a
    CPU storage at its size: --offload-train shrinks every storage to zero after the first update."""
    weights = [("w", torch.randn(5, 7)), ("b", torch.randn(3).bfloat16()), ("mask", torch.tensor([True, False]))]
    reference = b"".join(t.view(torch.uint8).numpy().tobytes() for t in (w.clone() for _, w in weights))
    assert b"".join(bytes(p) for _, t in weights for p in tensor_bytes(t, chunk=6)) == reference  # chunk edges
    write_stage_file(tmp_path, 0, weights)
    changed_tensors(weights, {})
    for name, t in weights:
        assert t.untyped_storage().resizable(), name
        t.untyped_storage().resize_(0)  # what TrainStateOffloader does
    assert list(tensor_bytes(torch.zeros(0))) == []


def test_engine_set_key_changes_with_the_engines_only():
    calls = []

    def address():
        calls.append(1)
        return "127.0.0.1", 1000 + len(calls)

    state = {}  # what the driver's transport keeps for the run
    k1, a1 = engine_set_key(state, ["http://a", "http://b"], address)
    assert engine_set_key(state, ["http://a", "http://b"], address) == (k1, a1) and len(calls) == 1
    k2, a2 = engine_set_key(state, ["http://a"], address)
    assert k2 != k1 and a2 != a1
    assert engine_set_key(state, ["http://a", "http://b"], address)[0] not in (k1, k2)  # back to a set: still new


def test_engine_command_adds_the_worker_extension(tiny_qwen3):
    from vime.engine.control.engine import engine_command
    from vime.arguments import parse_args

    base = ["--hf-checkpoint", str(tiny_qwen3), *ARGV]
    cmd = engine_command(parse_args(base), "127.0.0.1", 8000, 0)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    disk = base[:base.index("broadcast")] + ["disk"] + base[base.index("broadcast") + 1:]
    cmd = engine_command(parse_args(disk), "127.0.0.1", 8000, 0)  # every transport loads through it
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    assert DiskDriver(DriverSetup.of(parse_args(disk))).load_call("/d") == ("vime_load_weights", {"path": "/d"})
    mine = parse_args(base + ["--vllm-worker-extension-cls", "my.Ext"])
    cmd = engine_command(mine, "127.0.0.1", 8000, 0)
    assert cmd.count("--worker-extension-cls") == 1 and cmd[cmd.index("--worker-extension-cls") + 1] == "my.Ext"
    # engines without vime's methods (another extension, or started elsewhere) reload with vLLM's own method
    external = parse_args(disk + ["--rollout-external-engine-addrs", "127.0.0.1:1"])
    for args in (mine, external):
        assert DiskDriver(DriverSetup.of(args)).load_call("/d") == ("reload_weights", {"weights_path": "/d"})


def test_compare_log_probs_and_tolerance(tiny_qwen3):
    from vime.arguments import parse_args

    assert compare_log_probs([-1.0, -2.0], [[-1.0, -2.0 + 5e-6]], ["u"], 1e-5)["weight_check/max_abs_logprob_diff"] \
        == pytest.approx(5e-6)
    with pytest.raises(WeightUpdateMismatchError, match="u2"):
        compare_log_probs([-1.0, -2.0], [[-1.0, -2.0], [-1.0, float("nan")]], ["u1", "u2"], 1e-5)
    # float32 rounding grows with the log-prob's size: 1.4e-5 passes at -15, not at -1
    assert compare_log_probs([-15.0], [[-15.0 + 1.4e-5]], ["u"], 1e-5)["weight_check/max_abs_logprob_diff"] \
        == pytest.approx(1.4e-5, abs=1e-7)
    with pytest.raises(WeightUpdateMismatchError, match="u"):
        compare_log_probs([-1.0], [[-1.0 + 1.4e-5]], ["u"], 1e-5)
    cpu_float32 = ("float32", "cpu")  # what a CPU trainer reports (MegatronTrainer.compute_kind)
    assert tolerance_for(parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV]), cpu_float32) == FLOAT32_TOLERANCE
    # without --vllm-dtype the engines follow the trainer (float32 on CPU); a 16-bit engine needs the loose check
    default = [a for a in ARGV if a not in ("--vllm-dtype", "float32")]
    assert tolerance_for(parse_args(["--hf-checkpoint", str(tiny_qwen3), *default]),
                         cpu_float32) == FLOAT32_TOLERANCE
    half = parse_args(["--hf-checkpoint", str(tiny_qwen3), *default, "--vllm-dtype", "bfloat16"])
    assert tolerance_for(half, cpu_float32) > FLOAT32_TOLERANCE



def test_update_weights_runs_send_and_apply_together_for_a_collective(fake_ray, tiny_qwen3):
    """A broadcast deadlocks unless both halves run at once; disk must apply only after the files exist."""
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV])
    both = threading.Barrier(2, timeout=10)
    order = []

    class Collective(WeightTransport):
        concurrent = True

        def prepare(self, version):
            return version

        def send(self, trainer, handle):
            both.wait()

        def load_calls(self, urls, handle):
            both.wait()
            return {}

        def cleanup(self, handle):
            order.append("cleanup")

    class Files(Collective):
        concurrent = False

        def send(self, trainer, handle):
            order.append("send")

        def load_calls(self, urls, handle):
            order.append("apply")
            return {}

    from vime.transport import weights as weight_transport

    fake_trainer = SimpleNamespace(args=args, send_weights=lambda transport, handle: transport.send(None, handle))
    for name, cls in (("collective", Collective), ("files", Files)):
        weight_transport.TRANSPORTS[name] = cls
        try:
            group, manager, _ = driver(fake_trainer, [], fake_ray)  # no engines: the control calls are no-ops
            metrics = update_weights(argparse.Namespace(**{**vars(args), "update_weight_transport": name}),
                                     group, manager, version=1)
        finally:
            del weight_transport.TRANSPORTS[name]
        assert metrics["perf/update_weights_time"] >= metrics["perf/update_weights_apply_time"] >= 0
        assert metrics["perf/update_weights_time"] >= metrics["perf/update_weights_stage_time"] >= 0
    assert order == ["cleanup", "send", "apply", "cleanup"]


def test_staged_update_writes_weights_while_the_rollout_still_generates(fake_ray, tiny_qwen3):
    """train_async: the trainer half (files written) overlaps the running rollout; the pause waits for it."""
    import time

    from vime.transport import weights as weight_transport
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV])
    order, generating = [], threading.Event()

    class Files(WeightTransport):
        concurrent = False

        def prepare(self, version):
            return version

        def send(self, trainer, handle):
            order.append("send")
            generating.set()  # the rollout may end only after the weights are written: proves the overlap

        def load_calls(self, urls, handle):
            order.append("apply")
            return {}

        def cleanup(self, handle):
            pass

    def rollout():
        assert generating.wait(10)
        time.sleep(0.1)
        order.append("rollout done")

    fake_trainer = SimpleNamespace(args=args, send_weights=lambda transport, handle: transport.send(None, handle))
    weight_transport.TRANSPORTS["files"] = Files
    try:
        group, manager, raw = driver(fake_trainer, [], fake_ray)
        pending = fake_ray.submit(rollout)
        metrics = update_weights(argparse.Namespace(**{**vars(args), "update_weight_transport": "files"}),
                                 group, manager, version=1, after=[pending])
    finally:
        del weight_transport.TRANSPORTS["files"]
    assert order == ["send", "rollout done", "apply"]  # the engines' pause is part of the apply
    assert metrics["perf/update_weights_time"] < 5  # the wait for the rollout is not counted as update time


def test_fault_tolerance_leaves_a_recovery_copy_for_restarted_engines(fake_ray, tiny_qwen3, tmp_path, monkeypatch):
    """--use-fault-tolerance: the disk update directory itself is kept (not cleaned up) and handed to the manager
    as the recovery copy; any other transport gets an extra HF write into a vime_recovery_* directory."""
    from vime.transport import weights as weight_transport
    from vime.transport.weights.disk.rank import DiskSender
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV, "--use-fault-tolerance",
                       "--update-weight-dir", str(tmp_path)])
    written = []
    monkeypatch.setattr(DiskSender, "send", lambda self, trainer, handle: written.append(handle))
    cleaned = []

    class Memory(WeightTransport):
        def prepare(self, version):
            return {"version": version}

        def send(self, trainer, handle):
            pass

        def load_calls(self, urls, handle):
            return {}

        def cleanup(self, handle):
            cleaned.append(handle)

    fake_trainer = SimpleNamespace(args=args, send_weights=lambda transport, handle: transport.send(None, handle))
    recoveries = []
    weight_transport.TRANSPORTS["memory"] = Memory
    try:
        for name in ("disk", "memory"):
            group, manager, raw = driver(fake_trainer, [], fake_ray)
            raw.apply_weights = lambda transport, handle, version, recovery_dir=None, pause_mode="wait": \
                recoveries.append(recovery_dir) or {}
            update_weights(argparse.Namespace(**{**vars(args), "update_weight_transport": name}), group, manager, 3)
    finally:
        del weight_transport.TRANSPORTS["memory"]
    disk_dir, memory_copy = recoveries
    assert Path(disk_dir).is_dir() and Path(disk_dir).parent == tmp_path and written[0] == disk_dir
    assert Path(memory_copy).name.startswith("vime_recovery_") and written[1] == memory_copy
    assert cleaned == [{"version": 3}]  # the in-memory transport is cleaned up; the kept disk directory is not



def test_cuda_ipc_handles_cross_as_json_not_pickle():
    """The rebuild arguments torch's reduce_tensor gives a CUDA tensor (their exact types, in order) survive the
    JSON round trip; anything outside them is refused. (Mapping real handles needs a GPU: tests/gpu.)"""
    import json

    import pytest
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from vime.engine.protocol.ipc_codec import decode_rebuild_args, encode_rebuild_args

    args = (torch.nn.Parameter, torch.Size([4, 8]), (8, 1), 0, torch.UntypedStorage, torch.bfloat16, 0,
            b"\x00\x01handle\xff", 64, 128, False, b"ref\x00", 16, b"\x02event", True)
    encoded = json.loads(json.dumps(encode_rebuild_args((rebuild_cuda_tensor, args))))
    decoded = decode_rebuild_args(encoded)
    assert decoded == list(args) and type(decoded[1]) is torch.Size
    with pytest.raises(ValueError, match="CUDA tensors only"):
        encode_rebuild_args((len, args))
    with pytest.raises(KeyError):
        decode_rebuild_args([["class", "os.system"], *encoded[1:]])
    with pytest.raises(ValueError, match="unknown argument kind"):
        decode_rebuild_args([["pickle", "gASV"], *encoded[1:]])

