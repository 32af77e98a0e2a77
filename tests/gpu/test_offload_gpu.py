"""--offload-train on a GPU, without Megatron: vime's offloader returns the device memory of a training rank's
tensors (parameters, views into one flat buffer as DDP's, Adam's state) and brings them back bit-exact, in place;
and the tensors cuda_ipc exports for two engines are freed once both engines let go and the rank releases them
(torch counts one consumer per export). Skipped without a GPU; their CPU halves: tests/unit/test_engine_memory.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def test_offload_returns_device_memory_and_onload_restores_it_bit_exact():
    from vime.trainer.offload import TrainStateOffloader, train_state_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)).cuda()
    flat = torch.randn(4 * MIB // 4, device="cuda")  # a contiguous buffer that views point into, as DDP's
    views = [flat[:1000].view(10, 100), flat[5000:9000]]
    host_side = torch.randn(100)  # not on the device: stays where it is
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    adam.step()  # Adam's moments now exist on the device
    optimizer = SimpleNamespace(optimizer=adam)  # what `train_state_tensors` reads of Megatron's wrapper
    tensors = list(train_state_tensors([model], optimizer, extra=[*views, flat, host_side]))
    before = {id(t): t.detach().to("cpu", copy=True) for t in tensors}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()

    off = TrainStateOffloader()
    moved = off.offload(tensors)
    assert moved == sum(storages.values()) >= 4 * MIB  # each device storage once, however many views it has
    assert torch.cuda.memory_allocated() <= allocated - moved  # every device byte it moved left the device
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors if t.is_cuda)
    assert host_side.untyped_storage().nbytes() == 400
    assert off.offload(tensors) == 0  # nothing more until onload

    assert off.onload() == moved
    assert torch.cuda.memory_allocated() == allocated
    for t in tensors:
        assert torch.equal(t.cpu(), before[id(t)]), t.shape  # bit-exact
    flat[0] = 123.0
    assert views[0][0, 0].item() == 123.0  # the views still point into the same buffer
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    adam.step()  # and training continues on them


def test_cuda_ipc_exports_are_freed_once_the_engines_loaded_them(tmp_path):
    """Two engines (processes here) map the writer's exports and let them go; the writer's `release` then
    returns the memory. One export mapped by both would keep it in torch's limbo for good."""
    from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.cuda_ipc.driver import CudaIpcDriver
    from vime.transport.weights.cuda_ipc.rank import CudaIpcSender
    from vime.config.train import WeightSyncConfig

    root = tmp_path / "root"
    driver = CudaIpcDriver(DriverSetup(WeightSyncConfig(update_weight_dir=str(root))))
    driver.connect(["http://e0", "http://e1"], lambda: None)
    writer = CudaIpcSender()
    handle = driver.prepare(version=1)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    weights = [("model.embed_tokens.weight", torch.randn(1024, 1024, device="cuda")),
               ("lm_head.weight", torch.randn(2048, 1024, device="cuda")[:, :512])]  # one needs a contiguous copy
    expected = {name: t.contiguous().cpu() for name, t in weights}
    torch.save(expected, tmp_path / "expected.pt")
    writer.send(weights, 0, handle)
    del weights  # the trainer's own tensors: gone after an update's send
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - baseline >= 6 * MIB  # the exports the engines map

    calls = driver.load_calls(["http://e0", "http://e1"], handle)
    reader = textwrap.dedent("""
        import gc, sys
        import torch
        from vime.engine.in_vllm.cuda_ipc import open_ipc_tensors
        expected = torch.load(sys.argv[2])
        got = dict(open_ipc_tensors(sys.argv[1], torch.cuda.current_device()))
        assert set(got) == set(expected)
        for name, tensor in got.items():
            assert torch.equal(tensor.cpu(), expected[name]), name
        del got, tensor  # an engine lets go of the mapped tensors once its weights hold the copy
        gc.collect()
        torch.cuda.synchronize()
        print("ok")
    """)
    env = {**os.environ, WEIGHT_ROOT_ENV: str(root), "PYTHONPATH": str(REPO)}
    for url in ("http://e0", "http://e1"):
        proc = subprocess.run([sys.executable, "-c", reader, calls[url][1]["path"], str(tmp_path / "expected.pt")],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]

    assert writer.release() >= 6 * MIB
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline  # nothing stayed in torch's limbo
    driver.cleanup(handle)
    assert not Path(handle).exists()
