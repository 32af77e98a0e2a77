"""Weight transports on the real stack: one vLLM engine (started with vime's worker extension) and the real
Megatron trainer in this process, driven by the real `update_weights` and `check_weights_equal` (Ray's
`.remote` / `get` / `wait` stand-ins run the calls on threads: no Ray cluster). Each transport gets weights the
engine does not have (noise added to the trainer's parameters); afterwards the engine's prompt log-probs of a
probe sequence must equal the trainer's within 1e-5 (float32), and must have differed before. The wire protocol
and the bookkeeping are also tested on their own (no engine): buckets, multi-sender broadcast (pipeline
stages), delta's layer grouping, send and apply running concurrently.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("megatron.core")

from vime.backends.weight_transport.base import WeightTransport, tensor_bytes  # noqa: E402
from vime.backends.weight_transport.broadcast import (broadcast_weights, engine_set_key, join_group,  # noqa: E402
                                                      plan_buckets)
from vime.backends.weight_transport.check import (FLOAT32_TOLERANCE, WeightUpdateMismatchError,  # noqa: E402
                                                  check_weights_equal, compare_log_probs, engine_prompt_log_probs,
                                                  probe_tokens, tolerance_for)
from vime.backends.weight_transport.delta import changed_tensors, load_unit  # noqa: E402
from vime.backends.weight_transport.disk import DiskWeightTransport, write_stage_file  # noqa: E402
from vime.ray.weight_sync import WeightSync  # noqa: E402
from vime.utils.misc import find_free_port  # noqa: E402

EXTENSION = "vime.backends.weight_transport.worker_extension.WeightReceiver"
ARGV = ["--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl", "--rm-type", "math",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--micro-batch-size", "2",
        "--update-weight-transport", "broadcast", "--update-weight-buffer-size", str(64 * 1024),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "2048"]


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
    from vime.backends.vllm_utils.engine import engine_command
    from vime.arguments import parse_args

    base = ["--hf-checkpoint", str(tiny_qwen3), *ARGV]
    cmd = engine_command(parse_args(base), "127.0.0.1", 8000, 0)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    disk = base[:base.index("broadcast")] + ["disk"] + base[base.index("broadcast") + 1:]
    cmd = engine_command(parse_args(disk), "127.0.0.1", 8000, 0)  # every transport loads through it
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    assert DiskWeightTransport(parse_args(disk)).load_call("/d") == ("vime_load_weights", {"path": "/d"})
    mine = parse_args(base + ["--vllm-worker-extension-cls", "my.Ext"])
    cmd = engine_command(mine, "127.0.0.1", 8000, 0)
    assert cmd.count("--worker-extension-cls") == 1 and cmd[cmd.index("--worker-extension-cls") + 1] == "my.Ext"
    # engines without vime's methods (another extension, or started elsewhere) reload with vLLM's own method
    external = parse_args(disk + ["--rollout-external-engine-addrs", "127.0.0.1:1"])
    for args in (mine, external):
        assert DiskWeightTransport(args).load_call("/d") == ("reload_weights", {"weights_path": "/d"})


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


# ---- Ray stand-ins: `handle.method.remote(...)` runs on a thread and returns a future ------------------------
class _Handle:
    def __init__(self, obj, pool):
        self._obj, self._pool = obj, pool

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *a, **k: self._pool.submit(method, *a, **k))


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    def get(refs, timeout=None):
        return [r.result(timeout=120) for r in refs] if isinstance(refs, list) else refs.result(timeout=120)

    def wait_some(refs, num_returns=1, timeout=None):
        when = ALL_COMPLETED if num_returns == len(refs) else FIRST_COMPLETED
        done, _ = wait(refs, timeout=min(120, timeout or 120), return_when=when)
        ready = [r for r in refs if r in done][:num_returns]
        return ready, [r for r in refs if r not in ready]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait_some)
    with ThreadPoolExecutor(8) as pool:
        yield pool


def _probe(hf_checkpoint: str) -> list[int]:
    """The weight check's probe for this checkpoint's tokenizer (as RolloutManager.probe_tokens makes it)."""
    from transformers import AutoTokenizer

    return probe_tokens(len(AutoTokenizer.from_pretrained(hf_checkpoint)))


class _Manager:
    """The rollout manager's weight-related methods (as in RolloutManager), for one engine list."""

    def __init__(self, urls: list[str], hf_checkpoint: str):
        self.urls, self.written, self.hf_checkpoint = urls, [], hf_checkpoint

    def get_engine_urls(self):
        return list(self.urls)

    get_live_engine_urls = get_engine_urls  # (the probe of each engine is EngineFleet's, tested on its own)

    def probe_tokens(self):
        return _probe(self.hf_checkpoint)

    def apply_weights(self, transport, handle, version, recovery_dir=None, pause_mode="wait"):
        from vime.backends.vllm_utils import client

        if isinstance(handle, dict) and "dir" in handle:  # delta: remember what it wrote
            for f in sorted(Path(handle["dir"]).glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    self.written += list(st.keys())
        answers = client.update_weights_all(self.urls, transport.load_calls(self.urls, handle), version, pause_mode)
        self.answers = answers
        return answers[0]["timings"] if answers else {}

    def probe_log_probs(self, tokens, model):
        return engine_prompt_log_probs(self.urls, tokens, model=model)


def update_weights(args, group, manager, version: int, after=None) -> dict:
    """One update through a new driver-side `WeightSync` (what a run holds for its whole length)."""
    return WeightSync(args).update(group, manager, version, after=after)


def _driver(trainer, urls: list[str], pool):
    """(train group, rollout manager) as the driver sees them."""
    from vime.ray.actor_group import TrainActor

    actor = TrainActor(trainer.args, 0, 1)
    actor.trainer = trainer
    group = SimpleNamespace(actors=[_Handle(actor, pool)],
                            probe_log_probs=lambda *a, **k: [actor.probe_log_probs(*a, **k)],
                            compute_kind=actor.compute_kind)
    manager = _Manager(urls, trainer.args.hf_checkpoint)
    return group, _Handle(manager, pool), manager


def test_update_weights_runs_send_and_apply_together_for_a_collective(fake_ray, tiny_qwen3):
    """A broadcast deadlocks unless both halves run at once; disk must apply only after the files exist."""
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV])
    both = threading.Barrier(2, timeout=10)
    order = []

    class Collective(WeightTransport):
        concurrent = True

        def __init__(self, args):
            pass

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

    from vime.backends import weight_transport

    fake_trainer = SimpleNamespace(args=args, send_weights=lambda transport, handle: transport.send(None, handle))
    for name, cls in (("collective", Collective), ("files", Files)):
        weight_transport.TRANSPORTS[name] = cls
        try:
            group, manager, _ = _driver(fake_trainer, [], fake_ray)  # no engines: the control calls are no-ops
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

    from vime.backends import weight_transport
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV])
    order, generating = [], threading.Event()

    class Files(WeightTransport):
        concurrent = False

        def __init__(self, args):
            pass

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
        group, manager, raw = _driver(fake_trainer, [], fake_ray)
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
    from vime.backends import weight_transport
    from vime.backends.weight_transport.disk import DiskWeightTransport
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV, "--use-fault-tolerance",
                       "--update-weight-dir", str(tmp_path)])
    written = []
    monkeypatch.setattr(DiskWeightTransport, "send", lambda self, trainer, handle: written.append(handle))
    cleaned = []

    class Memory(WeightTransport):
        def __init__(self, args):
            pass

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
            group, manager, raw = _driver(fake_trainer, [], fake_ray)
            raw.apply_weights = lambda transport, handle, version, recovery_dir=None, pause_mode="wait": \
                recoveries.append(recovery_dir) or {}
            update_weights(argparse.Namespace(**{**vars(args), "update_weight_transport": name}), group, manager, 3)
    finally:
        del weight_transport.TRANSPORTS["memory"]
    disk_dir, memory_copy = recoveries
    assert Path(disk_dir).is_dir() and Path(disk_dir).parent == tmp_path and written[0] == disk_dir
    assert Path(memory_copy).name.startswith("vime_recovery_") and written[1] == memory_copy
    assert cleaned == [{"version": 3}]  # the in-memory transport is cleaned up; the kept disk directory is not


# ---- one engine, the real trainer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_qwen3, tmp_path_factory):
    """(args, trainer, engine url). One after the other: the trainer's rendezvous port and the booting engine's
    internal ports are picked free-then-bound, and overlapping the two has collided."""
    from vime.backends.megatron_utils.parallel import destroy_parallel
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.arguments import parse_args

    out = tmp_path_factory.mktemp("weight_transport")
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV, "--output-dir", str(out),
                       "--update-weight-dir", str(out)])
    trainer = MegatronTrainer(args)
    engine = VLLMEngine(args, 0, str(out))
    try:
        yield args, trainer, engine.start()
    finally:
        engine.stop()
        destroy_parallel()


@pytest.fixture
def sync(stack, fake_ray):
    """sync(transport name, version) -> what delta wrote; runs the real `WeightSync.update`, one driver-side
    `WeightSync` per transport as a run keeps it."""
    args, trainer, url = stack
    group, manager, state = _driver(trainer, [url], fake_ray)
    syncs: dict[str, WeightSync] = {}

    def push(name: str, version: int, in_flight: bool = False) -> list[str]:
        state.written = []
        if name not in syncs:
            syncs[name] = WeightSync(argparse.Namespace(**{**vars(args), "update_weight_transport": name}))
        syncs[name].update(group, manager, version, in_flight=in_flight)
        return state.written

    push.check = lambda: check_weights_equal(args, group, manager)
    push.answers = lambda: state.answers  # the engines' answers to the last update
    push.driver = lambda name: syncs[name].transport  # the driver's transport
    push.writer = lambda name: group.actors[0]._obj.weight_transports[name]  # the training rank's
    yield push
    for transport in group.actors[0]._obj.weight_transports.values():
        if hasattr(transport, "close"):
            transport.close()


_seeds = itertools.count()


def _perturb(trainer, only: dict[str, slice] | None = None, scale: float = 0.02) -> None:
    """Noise on every parameter, or on the given rows of the named Megatron parameters only."""
    g = torch.Generator().manual_seed(next(_seeds))
    with torch.no_grad():
        for chunk in trainer.model:
            for name, p in chunk.module.named_parameters():
                if only is None:
                    p.add_(torch.randn(p.shape, generator=g) * scale)
                elif name in only:
                    rows = p[only[name]]
                    rows.add_(torch.randn(rows.shape, generator=g) * scale)


def _max_diff(trainer, url: str, tokens: list[int]) -> float:
    ours = trainer.probe_log_probs(tokens, len(tokens) - 1, temperature=1.0)
    theirs = engine_prompt_log_probs([url], tokens)[0]
    return compare_log_probs(ours, [theirs], [url], float("inf"))["weight_check/max_abs_logprob_diff"]


@pytest.mark.parametrize("name", ["disk", "broadcast", "delta"])
def test_transport_makes_the_engine_serve_the_trainers_weights(stack, sync, name):
    args, trainer, url = stack
    tokens = _probe(args.hf_checkpoint)
    _perturb(trainer)
    assert _max_diff(trainer, url, tokens) > 1e-3  # the engine does not have these weights yet
    with pytest.raises(WeightUpdateMismatchError, match=url):
        sync.check()
    sync(name, version=1)
    assert sync.answers()[0]["results"][0]["in_place"] is True  # vime's loader, not vLLM's layerwise reload
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE
    assert sync.check()["weight_check/max_abs_logprob_diff"] <= FLOAT32_TOLERANCE


def test_broadcast_group_is_reused_and_rebuilt_for_new_engines(stack, sync):
    args, trainer, url = stack
    tokens = _probe(args.hf_checkpoint)
    sync("broadcast", version=2)
    first = sync.writer("broadcast").group["pg"]
    _perturb(trainer)
    sync("broadcast", version=3)
    assert sync.writer("broadcast").group["pg"] is first  # same engines: same group
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE
    engine_set_key(sync.driver("broadcast").engine_set, ["http://another-engine"])  # the driver saw another set
    _perturb(trainer)
    sync("broadcast", version=4)
    assert sync.writer("broadcast").group["pg"] is not first  # rebuilt, on both sides
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE


def test_delta_sends_only_changed_layers_and_they_suffice(stack, sync):
    args, trainer, url = stack
    tokens = _probe(args.hf_checkpoint)
    sync("delta", version=5)  # the engine now has what the trainer has
    assert sync("delta", version=6) == []  # nothing changed: nothing sent
    # Rows 0-7 of layer 1's linear_qkv are query rows only: HF q_proj changes, k_proj and v_proj do not.
    _perturb(trainer, {"decoder.layers.1.self_attention.linear_qkv.weight": slice(0, 8),
                       "decoder.final_layernorm.weight": slice(None)}, scale=0.2)
    assert _max_diff(trainer, url, tokens) > 1e-3
    written = sync("delta", version=7)
    assert sorted(written) == sorted([f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
                                     + ["model.norm.weight"])
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE


def test_one_call_update_on_the_engine_and_its_fallback(stack):
    """vime's route on the real engine: one POST pauses, loads, versions and resumes; a failed load names the
    route and leaves the engine paused; the separate-call fallback (engines without the plugin) does the same."""
    from vime.backends.vllm_utils import client
    from vime.backends.vllm_utils.endpoint import ROUTE

    args, trainer, url = stack
    tokens = _probe(args.hf_checkpoint)
    reload = {url: ("reload_weights", {"weights_path": args.hf_checkpoint})}

    def state() -> tuple[bool, str]:
        return (client.http().get(url + "/is_paused").json()["is_paused"],
                client.http().get(url + "/weight_info").json()["weight_version"])

    try:
        with pytest.raises(client.EngineControlError, match=f"{ROUTE}.*vime_no_such_method"):
            client.update_weights_all([url], {url: ("vime_no_such_method", {})}, 41)
        assert state()[0] is True  # not resumed after a failed load
        answer = client.update_weights_all([url], reload, 42)[0]
        assert state() == (False, "42") and answer["timings"]["load_s"] > 0
        assert set(answer["timings"]) == {"pause_s", "load_s", "finish_s"}
        served = engine_prompt_log_probs([url], tokens)[0]  # generation runs again: the checkpoint's weights

        client._without_update_route.add(url)
        _perturb(trainer)  # nothing pushed: only the version moves, then the checkpoint again
        client.update_weights_all([url], {}, 43)
        assert state() == (False, "43")
        client.update_weights_all([url], reload, 44)
        assert state() == (False, "44")
        assert engine_prompt_log_probs([url], tokens)[0] == pytest.approx(served, abs=FLOAT32_TOLERANCE)
    finally:
        client._without_update_route.discard(url)
        client.resume([url])


def test_engine_worker_sleeps_soon_after_a_call(stack):
    """The engine computes idle soon after a call: no busy-wait of vLLM's (1 s of a core after each message between
    an engine core and a worker process, capped by vime's engine plugin; a one-worker CPU engine has none)."""
    import time

    from tests.e2e.processes import engine_compute_processes
    from vime.backends.vllm_utils import client

    args, trainer, url = stack
    workers = engine_compute_processes()
    assert len(workers) == 1

    def busy() -> float:
        t = workers[0].cpu_times()
        return t.user + t.system

    client.update_weights_all([url], {}, 50)
    before = busy()
    time.sleep(1.0)
    assert busy() - before < 0.4  # vLLM's own 1 s spin costs a whole CPU-second here


def test_cuda_ipc_handles_cross_as_json_not_pickle():
    """The rebuild arguments torch's reduce_tensor gives a CUDA tensor (their exact types, in order) survive the
    JSON round trip; anything outside them is refused. (Mapping real handles needs a GPU: tests/gpu.)"""
    import json

    import pytest
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from vime.backends.weight_transport.cuda_ipc import decode_rebuild_args, encode_rebuild_args

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


def test_an_in_flight_update_switches_a_running_request_to_the_new_weights(stack, sync):
    """An update while the engine generates (train_async --update-weights-in-flight): the request is kept, its
    tokens carry two version spans, and every token after the update has exactly the new weights' log-prob on
    its whole context (the kept request's KV was recomputed, not reused from the old weights)."""
    import time

    from vime.backends.vllm_utils import client

    args, trainer, url = stack
    prompt = _probe(args.hf_checkpoint)[:8]
    sync("disk", version=50)  # the engine serves the trainer's weights
    body = {"token_ids": prompt, "model": "policy",
            "sampling_params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 1.0, "logprobs": 0}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: client.http().post(url + "/inference/v1/generate", json=body, timeout=300))
        time.sleep(0.5)  # a few hundred of its 1500 decode steps
        _perturb(trainer, scale=0.05)
        sync("disk", version=51, in_flight=True)
        answer = pending.result(timeout=300)
    assert answer.status_code == 200, answer.text[:500]
    choice = answer.json()["choices"][0]
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["50", "51"], spans
    boundary = spans[0]["end"]
    assert 0 < boundary == spans[1]["start"] < spans[1]["end"] == 1500, spans
    engine = [c["logprob"] for c in choice["logprobs"]["content"]]
    new = trainer.probe_log_probs(prompt + choice["token_ids"], 1500, temperature=1.0)
    after = max(abs(a - b) for a, b in zip(engine[boundary:], new[boundary:]))
    before = max(abs(a - b) for a, b in zip(engine[:boundary], new[:boundary]))
    assert after <= 10 * FLOAT32_TOLERANCE, after  # sampled by the new weights, on a recomputed cache
    assert before > 1e-3, before  # sampled by the old ones
