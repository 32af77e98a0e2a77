"""The trainer's weights into another process on the GPU, as an engine would get them (skipped without a GPU).

The receiver is a separate process running vime's engine-side method (`worker_extension.WeightReceiver`: the CUDA
IPC load, or the broadcast receive), with vLLM's model load replaced by a transformers copy of the model on the GPU:
every tensor it gets must equal the trainer's HF weights bit for bit, and its log-probs of a fixed token batch must
then be the trainer's own (`probe_log_probs`) within vime's tolerance for the trainer's dtype, and must have differed
before (the trainer took a step away from the checkpoint first).

- CUDA IPC (colocated GPUs, one GPU): the trainer writes its handles (`CudaIpcSender.send` through
  `MegatronTrainer.send_weights`); the receiver maps them (`vime_load_ipc_weights`).
- NCCL broadcast (tests/unit/test_weight_transport.py does it over gloo on CPU): the trainer broadcasts
  (`BroadcastSender`) to a receiver on another GPU (`vime_receive_weights`). NCCL refuses two ranks on one
  GPU, so this needs 2 GPUs; and vime's group is vLLM's stateless process group, so it needs vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
if torch.cuda.is_available():  # without a GPU every test skips: Megatron need not be imported to say so
    pytest.importorskip("megatron.core")

from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"fp32": (), "bf16": ("--bf16",)}

# The engine's side in its own process: argv[1] = spec JSON {"mode", "hf", "expected", "tokens", "call", "out"}.
RECEIVER = r'''
import json, sys
import torch
from transformers import AutoModelForCausalLM
from vime.engine.in_vllm.worker_extension import WeightReceiver

spec = json.load(open(sys.argv[1]))
expected = torch.load(spec["expected"])
model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32, attn_implementation="eager")
model = model.cuda().eval()


def log_probs():
    out = []
    for tokens in spec["tokens"]:
        ids = torch.tensor([tokens], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
    return out


class Engine(WeightReceiver):
    """What vLLM's worker is to vime's extension: a rank, a device and a model to load into."""
    rank = 0
    device = torch.device("cuda", 0)

    def _vime_load(self, weights):
        received = {}
        for name, tensor in weights:
            assert tensor.is_cuda, name
            received[name] = tensor.clone()  # the trainer's memory (IPC) or a reused bucket (broadcast)
        torch.cuda.synchronize()
        self.received = received
        self.result = model.load_state_dict(received, strict=False)  # into float32: a cast, as vLLM's loaders
        return False


report = {"before": log_probs()}
engine = Engine()
if spec["mode"] == "ipc":
    report["stats"] = engine.vime_load_ipc_weights(**spec["call"])
else:
    report["stats"] = engine.vime_receive_weights(**spec["call"])
report["after"] = log_probs()
got = {name: tensor.cpu() for name, tensor in engine.received.items()}
report["missing"], report["unexpected"] = engine.result.missing_keys, engine.result.unexpected_keys
report["names"] = sorted(got) == sorted(expected)
report["differ"] = [n for n in expected if n not in got or got[n].dtype != expected[n].dtype
                    or not torch.equal(got[n], expected[n])]
json.dump(report, open(spec["out"], "w"))
'''


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _tolerance(kind: str, dtype) -> float:
    from vime.utils.tolerances import tolerance

    return tolerance(kind, dtype, "cuda")


def token_batch(vocab_size: int) -> list[list[int]]:
    """The weight check's probe sequence and two rollout-like sequences: what both sides score."""
    from vime.transport.weights.check import probe_tokens

    return [probe_tokens(vocab_size)] + [s["tokens"] for s in flat(make_rollout(seed=7))[:2]]


def start_receiver(tmp_path: Path, mode: str, hf_dir: Path, tokens: list, call: dict, env: dict) -> tuple:
    spec = {"mode": mode, "hf": str(hf_dir), "expected": str(tmp_path / "expected.pt"), "tokens": tokens,
            "call": call, "out": str(tmp_path / "receiver.json")}
    (tmp_path / "receiver_spec.json").write_text(json.dumps(spec))
    (tmp_path / "receiver.py").write_text(RECEIVER)
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(tmp_path / "receiver.log", "w")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "receiver.py"), str(tmp_path / "receiver_spec.json")],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def finish_receiver(tmp_path: Path, proc, log, timeout_s: float = 180.0) -> dict:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    assert proc.returncode == 0, f"receiver exited with {proc.returncode}:\n" \
        f"{(tmp_path / 'receiver.log').read_text()[-6000:]}"
    return json.loads((tmp_path / "receiver.json").read_text())


def check_received(report: dict, sent: dict, trainer_log_probs: list, dtype) -> None:
    """Bit-exact tensors, and the receiver's log-probs now the trainer's (and not before)."""
    assert report["names"] and not report["differ"], f"received != sent: {report['differ'][:5]}"
    assert report["stats"]["tensors"] == len(sent), report["stats"]
    assert not report["missing"] and not report["unexpected"], (report["missing"], report["unexpected"])
    absolute, relative = _tolerance("logprob", dtype), _tolerance("logprob_relative", dtype)
    moved = 0.0
    for k, (before, after, own) in enumerate(zip(report["before"], report["after"], trainer_log_probs)):
        before, after, own = (torch.tensor(x, dtype=torch.float64) for x in (before, after, own))
        diff = (after - own).abs()
        assert bool((diff <= absolute + relative * own.abs()).all()), \
            f"sequence {k}: the receiver's log-probs differ from the trainer's by {diff.max().item():.3g}"
        moved = max(moved, (before - own).abs().max().item())
    assert moved > absolute, f"the receiver's log-probs were the trainer's before the update ({moved:.3g})"


def trained_trainer(tiny_qwen3, config: str, *extra: str):
    """A trainer that took one step (lr 1e-2) away from the checkpoint the receiver starts from."""
    return local_trainer(tiny_qwen3, *CONFIGS[config], "--lr", "1e-2", *extra)


def sender_side(t, tmp_path: Path) -> tuple[dict, list, list, torch.dtype]:
    """After one step: the HF weights sent (saved for the receiver), the token batch, the trainer's log-probs."""
    from vime.utils.device import training_dtype

    t.train(0, make_rollout(seed=1))
    sent = {name: tensor.detach().cpu().clone() for name, tensor in t.hf_weights()}
    torch.save(sent, tmp_path / "expected.pt")
    tokens = token_batch(t.hf_config.vocab_size)
    own = [t.probe_log_probs(seq, len(seq) - 1, temperature=1.0) for seq in tokens]
    return sent, tokens, own, getattr(torch, training_dtype(t.args))


@pytest.mark.parametrize("config", CONFIGS)
def test_cuda_ipc_transport_gives_the_receiver_the_trainers_log_probs(tiny_qwen3, tmp_path, config):
    from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.cuda_ipc.driver import CudaIpcDriver
    from vime.transport.weights.cuda_ipc.rank import CudaIpcSender
    from vime.config.train import WeightSyncConfig

    root = tmp_path / "root"
    with trained_trainer(tiny_qwen3, config) as t:
        sent, tokens, own, dtype = sender_side(t, tmp_path)
        driver, writer = CudaIpcDriver(DriverSetup(WeightSyncConfig(update_weight_dir=str(root)))), CudaIpcSender()
        handle = driver.prepare(version=1)
        t.send_weights(writer, handle)  # the writer keeps the tensors alive until the next update
        assert sorted(p.name for p in Path(handle).iterdir()) == ["stage_0.json"]
        call = driver.load_calls(["http://engine"], handle)["http://engine"]
        assert call[0] == "vime_load_ipc_weights"
        proc, log = start_receiver(tmp_path, "ipc", tiny_qwen3, tokens, call[1], {WEIGHT_ROOT_ENV: str(root)})
        report = finish_receiver(tmp_path, proc, log)
        driver.cleanup(handle)
    assert not Path(handle).exists()
    check_received(report, sent, own, dtype)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU (the receiver needs its own)")
@pytest.mark.skipif(not _installed("vllm"), reason="needs vLLM: vime's broadcast group is vLLM's stateless group")
@pytest.mark.parametrize("config", CONFIGS)
def test_nccl_broadcast_gives_the_receiver_the_trainers_log_probs(tiny_qwen3, tmp_path, config):
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.broadcast.driver import BroadcastDriver
    from vime.transport.weights.broadcast.rank import BroadcastSender
    from vime.config.rollout import EnginesConfig
    from vime.config.train import MegatronConfig, WeightSyncConfig
    from vime.utils.misc import find_free_port

    url = "http://engine"
    # 64 KiB buckets: the norms travel packed, the matrices (64 KiB or more) each on their own
    with trained_trainer(tiny_qwen3, config, "--update-weight-buffer-size", str(64 * 1024)) as t:
        sent, tokens, own, dtype = sender_side(t, tmp_path)
        setup = DriverSetup(WeightSyncConfig.of(t.args), MegatronConfig.of(t.args), EnginesConfig.of(t.args))
        driver, writer = BroadcastDriver(setup), BroadcastSender()
        driver.connect([url], lambda: ("127.0.0.1", find_free_port()))
        handle = driver.prepare(version=1)
        assert "backend" not in handle and handle["world_size"] == 2  # each member picks NCCL for its GPU
        method, kwargs = driver.load_calls([url], handle)[url]
        assert method == "vime_receive_weights"
        proc, log = start_receiver(tmp_path, "broadcast", tiny_qwen3, tokens, kwargs, {"CUDA_VISIBLE_DEVICES": "1"})
        failure = []

        def send():  # blocks until the receiver has joined the group and taken every tensor
            try:
                t.send_weights(writer, handle)
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 180
        while sender.is_alive() and proc.poll() in (None, 0) and time.monotonic() < deadline:
            sender.join(timeout=0.5)
        report = finish_receiver(tmp_path, proc, log, timeout_s=max(1.0, deadline - time.monotonic()))
        sender.join(timeout=30)
        assert not sender.is_alive(), "the sender still waits in the broadcast after the receiver finished"
        assert not failure, failure
        writer.close()
    check_received(report, sent, own, dtype)
