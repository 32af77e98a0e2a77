"""Colocated memory (--colocate, --offload-rollout, --offload-train): the engine command on a GPU machine (sleep
mode, the GPU share `engine_memory_fraction` gives, the user's --vllm-* values winning), the sleep / wake-up calls
the fleet sends in the order train.py's loop makes them, restarts of engines that die asleep, and the cuda_ipc
exports a training rank keeps for the engines, released before new ones are made and when the trainer offloads.
The GPU halves (memory really returned): tests/gpu/test_offload_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vime.arguments import parse_args
from vime.engine.control.engine import engine_command, engine_memory_fraction
from vime.rollout.context import RolloutContext
from vime.rollout_manager import engine_fleet, fleet_recovery
from vime.rollout_manager.engine_fleet import EngineFleet
import vime.utils.device

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def argv(tiny_qwen3, arithmetic_data):
    return ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math"]


def _gpu_command(monkeypatch, argv) -> list[str]:
    args = parse_args(argv)  # parsed as this CPU machine parses them; the engine's actor reads its own device
    monkeypatch.setattr(vime.utils.device, "use_gpu", lambda: True)
    return engine_command(args, "127.0.0.1", 8000, 0)


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


# ---- the engine command ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, sleep_mode, utilization", [
    ([], False, None),  # engines on GPUs of their own: vLLM's default
    (["--colocate"], False, "0.3"),  # the trainer's state stays next to the engine: it gets the rest
    (["--colocate", "--offload-train"], False, "0.3"),  # the awake engine stays next to the training trainer
    (["--colocate", "--offload-rollout"], True, "0.3"),  # the trainer's state stays while the engines generate
    (["--colocate", "--offload-rollout", "--offload-train"], True, "0.8"),  # each phase has the GPU to itself
    (["--colocate", "--offload-rollout", "--offload-train", "--debug-rollout-only"], True, None),  # no trainer
])
def test_gpu_engines_get_sleep_mode_and_the_colocated_share(monkeypatch, argv, extra, sleep_mode, utilization):
    cmd = _gpu_command(monkeypatch, argv + extra)
    assert ("--enable-sleep-mode" in cmd) is sleep_mode
    assert _value(cmd, "--gpu-memory-utilization") == utilization


def test_a_critic_on_the_same_gpus_leaves_the_engine_less():
    def args(**flags):
        return SimpleNamespace(**{"colocate": True, "offload_train": False, "offload_rollout": False,
                                  "use_critic": False, "debug_rollout_only": False, **flags})

    assert engine_memory_fraction(args()) == 0.3
    assert engine_memory_fraction(args(use_critic=True)) == 0.2
    assert engine_memory_fraction(args(use_critic=True, offload_train=True, offload_rollout=True)) == 0.8
    assert engine_memory_fraction(args(colocate=False)) is None


def test_the_users_vllm_values_win(monkeypatch, argv):
    both = ["--colocate", "--offload-rollout", "--offload-train"]
    cmd = _gpu_command(monkeypatch, argv + both + ["--vllm-gpu-memory-utilization", "0.55"])
    assert cmd.count("--gpu-memory-utilization") == 1 and _value(cmd, "--gpu-memory-utilization") == "0.55"
    cmd = _gpu_command(monkeypatch, argv + both + ["--no-vllm-enable-sleep-mode"])
    assert "--enable-sleep-mode" not in cmd and "--no-enable-sleep-mode" in cmd
    cmd = _gpu_command(monkeypatch, argv + both + ["--vllm-enable-sleep-mode"])
    assert cmd.count("--enable-sleep-mode") == 1


def test_cpu_engines_start_as_before(argv):
    """vLLM refuses sleep mode on CPU (its platform is not one `is_sleep_mode_available` names), and a CPU engine
    sizes its KV cache from VLLM_CPU_KVCACHE_SPACE."""
    cmd = engine_command(parse_args(argv + ["--colocate", "--offload-rollout", "--offload-train"]), "h", 1, 0)
    assert "--enable-sleep-mode" not in cmd and "--gpu-memory-utilization" not in cmd


# ---- sleep and wake-up, as the fleet sends them --------------------------------------------------------------
@pytest.fixture
def fleet(monkeypatch, tmp_path):
    """A fleet of two engines with no Ray behind it: its control calls are recorded, not sent."""
    sent, tokens = [], []

    def post_each(token, urls, route, body=None, params=None, timeout=300.0):
        sent.append((route, params, list(urls)))
        tokens.append(token)
        return {}, {}

    monkeypatch.setattr(engine_fleet.client, "post_each", post_each)  # with a health monitor
    monkeypatch.setattr(engine_fleet.client, "post_all", post_each)  # without
    monkeypatch.setattr(fleet_recovery, "post_worker", lambda *a: sent.append(("router", a[2], [a[3]])))
    f = EngineFleet(SimpleNamespace(control_token_file=None, debug_train_only=False), None, tmp_path, RolloutContext())
    f.engine_urls = ["http://e0", "http://e1"]
    f.rank_urls = list(f.engine_urls)
    f.sent, f.tokens = sent, tokens
    return f


def test_wake_up_brings_back_only_what_sleeps_in_the_asked_order(fleet):
    fleet.wake_up()  # nothing sleeps: nothing is sent
    fleet.sleep()
    fleet.wake_up(["weights"])
    fleet.wake_up(["weights"])  # already awake
    fleet.wake_up()  # the rest
    urls = ["http://e0", "http://e1"]
    assert fleet.sent == [("/sleep", {"level": 1}, urls), ("/wake_up", {"tags": ["weights"]}, urls),
                          ("/wake_up", {"tags": ["kv_cache"]}, urls)]
    assert all(token is fleet.context.token for token in fleet.tokens)  # the run's, which its rollouts send too
    with pytest.raises(ValueError, match="none of vLLM's sleep tags"):
        fleet.wake_up(["weigths"])


def _load_train_py():
    spec = importlib.util.spec_from_file_location("vime_train_entry", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def _loop_events(monkeypatch, fleet, **flags) -> list:
    """train.py's loop over two rollouts with a session whose engine and trainer calls are recorded: its own
    offload / onload methods, the rest stubbed. Each event says what the engines had asleep at that moment."""
    from vime.driver import session as session_module
    from vime.driver.session import TrainingSession

    events = fleet.sent
    monkeypatch.setattr(session_module, "control", lambda ref, what: ref)  # the fake manager answers at once

    class Trainers:
        def offload(self):
            events.append(("trainer offload", sorted(fleet.asleep)))

        def onload(self):
            events.append(("trainer onload", sorted(fleet.asleep)))

    class Session(TrainingSession):
        def __init__(self, args):
            from vime.config.run import PlacementConfig
            from vime.config.train import WeightSyncConfig

            self.args, self.use_engines, self.critic, self.trainers = args, True, None, Trainers()
            # the sections its offload / onload methods read (the real session holds the run's RunConfig)
            self.config = SimpleNamespace(placement=PlacementConfig.of(args), weight_sync=WeightSyncConfig.of(args))
            self.manager = SimpleNamespace(sleep=_Remote(fleet.sleep), wake_up=_Remote(fleet.wake_up))
            self.metrics = SimpleNamespace(log=lambda *a: None)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self):
            return 0, 2

        def maybe_eval(self, rollout_id, force=False):
            pass

        def generate(self, rollout_id):
            events.append(("generate", sorted(fleet.asleep)))

        def collect(self, pending):
            return SimpleNamespace(rollout_id=0), {}

        def train(self, rollout):
            events.append(("train", sorted(fleet.asleep)))
            return {}

        def maybe_save(self, rollout_id, num_rollout):
            pass

        def update_weights(self, version, after=None):
            events.append(("update", sorted(fleet.asleep)))
            return {}

        def publish_checkpoint(self):
            pass

    entry = _load_train_py()
    monkeypatch.setattr(entry, "TrainingSession", Session)
    args = SimpleNamespace(**{"offload_rollout": True, "offload_train": True, "check_weight_update_equal": False,
                              **flags})
    entry.train(args)
    return [(e[0], e[1]) for e in events]


def test_the_kv_cache_wakes_after_the_update_and_the_trainers_offload(monkeypatch, fleet):
    step = [("generate", []), ("/sleep", {"level": 1}), ("trainer onload", ["kv_cache", "weights"]),
            ("train", ["kv_cache", "weights"]), ("/wake_up", {"tags": ["weights"]}), ("update", ["kv_cache"]),
            ("trainer offload", ["kv_cache"]), ("/wake_up", {"tags": ["kv_cache"]})]
    assert _loop_events(monkeypatch, fleet) == step + step


def test_the_weight_check_wakes_the_engines_whole_before_the_update(monkeypatch, fleet):
    """--check-weight-update-equal generates on the engines right after the update: no KV cache may sleep then."""
    events = _loop_events(monkeypatch, fleet, check_weight_update_equal=True)
    assert events[3:7] == [("train", ["kv_cache", "weights"]), ("/wake_up", {"tags": ["weights", "kv_cache"]}),
                           ("update", []), ("trainer offload", [])]
    assert [e for e in events if e[0] == "/wake_up"] == [("/wake_up", {"tags": ["weights", "kv_cache"]})] * 2


# ---- an engine that dies asleep --------------------------------------------------------------------------------
def test_an_engine_dead_while_asleep_leaves_service_and_restarts_once_all_is_awake(fleet):
    checks = []
    fleet.recovery.monitor = SimpleNamespace(check_soon=lambda rank=None: checks.append(rank))
    fleet.asleep = set(engine_fleet.SLEEP_TAGS)
    fleet.recovery.restart_engine(1, "its server process exited")  # would start a new engine in full: it must wait
    assert fleet.engine_urls == ["http://e0"] and ("router", "remove_worker", ["http://e1"]) in fleet.sent
    assert fleet.recovery.deferred == {1} and fleet.engines == []  # no engine actor was made
    fleet.wake_up(["weights"])
    assert checks == []  # the KV cache still sleeps
    fleet.wake_up()
    assert checks == [None] and fleet.sent[-1] == ("/wake_up", {"tags": ["kv_cache"]}, ["http://e0"])


def test_an_engine_joining_a_sleeping_fleet_sleeps_as_much(fleet):
    fleet.asleep = {"kv_cache"}  # between the weights' wake-up and the KV cache's
    fleet.match_sleep("http://new")
    assert fleet.sent == [("/sleep", {"level": 1}, ["http://new"]), ("/wake_up", {"tags": ["weights"]}, ["http://new"])]
    fleet.sent.clear()
    fleet.asleep = set()
    fleet.match_sleep("http://new")
    assert fleet.sent == []


# ---- cuda_ipc: what a training rank keeps for the engines ------------------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA calls the transport makes, on CPU tensors: the exports are recorded (no handle can be made
    without a GPU), each with the rebuild arguments a real one would have."""
    from torch.multiprocessing import reductions

    exports, collects = [], []

    def reduce_tensor(t):
        exports.append(t)
        return reductions.rebuild_cuda_tensor, (
            torch.Tensor, t.shape, t.stride(), 0, torch.UntypedStorage, t.dtype, 0, b"handle", t.nbytes, 0, False,
            b"ref", len(exports), b"event", True)

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collects.append(1))
    return SimpleNamespace(exports=exports, collects=collects)


def _driver(tmp_path, engines: int):
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.cuda_ipc.driver import CudaIpcDriver
    from vime.config.train import WeightSyncConfig

    t = CudaIpcDriver(DriverSetup(WeightSyncConfig(update_weight_dir=str(tmp_path / "root"))))
    t.connect([f"http://e{i}" for i in range(engines)], lambda: None)
    return t


def _writer():
    from vime.transport.weights.cuda_ipc.rank import CudaIpcSender

    return CudaIpcSender()  # a rank's own half knows no engines


def test_each_engine_maps_exports_of_its_own(tmp_path, fake_cuda):
    """torch counts one consumer per export: two engines mapping one export would leave its count below zero,
    and the memory in the producer's limbo for good."""
    driver, writer = _driver(tmp_path, 2), _writer()
    handle = driver.prepare(1)
    weights = [("a", torch.randn(4, 6)[:, :3]), ("b", torch.randn(5))]
    writer.send(weights, 0, handle)
    assert len(fake_cuda.exports) == 4  # two tensors, once per engine
    calls = driver.load_calls(["http://e1", "http://e0"], handle)
    for i in (0, 1):
        path = Path(calls[f"http://e{i}"][1]["path"])
        assert path == Path(handle) / f"engine_{i}"
        assert [e["name"] for e in json.loads((path / "stage_0.json").read_text())] == ["a", "b"]
    assert driver.bound_engines(handle) == ["http://e0", "http://e1"]
    with pytest.raises(ValueError, match="not among those this update was exported for"):
        driver.load_calls(["http://restarted"], handle)
    single = _driver(tmp_path, 1)  # one engine: the update directory itself, as before
    one = single.prepare(2)
    writer.send(weights, 0, one)
    assert [p.name for p in Path(one).iterdir()] == ["stage_0.json"] and single.bound_engines(one) is None
    assert single.load_calls(["http://e0"], one) == {"http://e0": ("vime_load_ipc_weights", {"path": one})}


def test_a_writers_exports_go_before_the_next_ones_are_made(tmp_path, fake_cuda):
    driver, writer = _driver(tmp_path, 1), _writer()
    writer.send([("a", torch.randn(4, 6)[:, :3])], 0, driver.prepare(1))
    kept = weakref.ref(writer.keepalive[0][1])  # the contiguous copy: the keepalive is all that holds it
    fake_cuda.exports.clear()
    alive_at_next_copy = []

    class Weight:  # the next update's tensor, noting whether the last one's copy still exists when it is copied
        def detach(self):
            return self

        def contiguous(self):
            alive_at_next_copy.append(kept() is not None)
            return torch.randn(4, 3)

    writer.send([("a", Weight())], 0, driver.prepare(2))
    assert alive_at_next_copy == [False] and len(writer.keepalive) == 1  # the peak is one copy, not two
    assert writer.release() == 4 * 3 * 4 and writer.keepalive == [] and fake_cuda.collects
    other = _writer()
    other.send([("a", torch.randn(3))], None, driver.prepare(3))  # not a writer: nothing is mapped, nothing kept
    assert other.keepalive == [] and len(fake_cuda.exports) == 1


def test_the_trainers_offload_releases_the_transports_first(tmp_path, fake_cuda):
    from vime.driver.train_group import TrainActor

    writer = _writer()
    writer.send([("a", torch.randn(8))], 0, _driver(tmp_path, 1).prepare(1))
    seen = []
    actor = TrainActor.__new__(TrainActor)  # its Ray-side set-up is not what is tested
    actor.rank, actor.role = 0, "actor"
    from vime.transport.weights.disk.rank import DiskSender

    disk = DiskSender()  # one without anything to release
    actor.weight_transports = {"cuda_ipc": writer, "disk": disk}
    actor.trainer = SimpleNamespace(offload=lambda: seen.append(list(writer.keepalive)) or 123)
    assert actor.offload() == 123
    assert seen == [[]]  # the exports were gone when the trainer's state moved (its empty_cache frees them)


# ---- the offloader -----------------------------------------------------------------------------------------------
def test_offload_moves_only_the_devices_storages():
    """Storages elsewhere than the device being freed stay (on GPU: host tensors; here: meta ones, which have no
    bytes to copy)."""
    from vime.trainer.offload import TrainStateOffloader

    kept, elsewhere = torch.arange(6, dtype=torch.float32), torch.empty(1000, device="meta")
    off = TrainStateOffloader()
    assert off.offload([kept, elsewhere]) == 24
    assert kept.untyped_storage().nbytes() == 0 and elsewhere.untyped_storage().nbytes() == 4000
    assert off.onload() == 24 and kept.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_failed_offload_leaves_the_state_as_it_was(monkeypatch):
    from vime.trainer import offload as offload_module

    a, b = torch.arange(4, dtype=torch.float32), torch.arange(8, dtype=torch.float32)
    real_empty, made = torch.empty, []

    def empty(*shape, **kw):  # host memory runs out at the second copy
        made.append(shape)
        if len(made) == 2:
            raise RuntimeError("out of host memory")
        return real_empty(*shape, **kw)

    monkeypatch.setattr(offload_module.torch, "empty", empty)
    off = offload_module.TrainStateOffloader()
    with pytest.raises(RuntimeError, match="out of host memory"):
        off.offload([a, b])
    monkeypatch.setattr(offload_module.torch, "empty", real_empty)
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.untyped_storage().nbytes() == 32 and not off.offloaded
    assert off.offload([a, b]) == 48  # and a later offload does its whole job
