"""CUDA IPC weight handles (colocated GPUs): a second process maps the trainer's tensors without a copy through
the host, from the JSON manifest the transport writes under the weight root. Skipped without a GPU. (The
manifest's encoding and its refusals are tested on CPU: tests/unit/test_untrusted_files.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]


def test_ipc_handles_open_in_another_process(tmp_path):
    from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.cuda_ipc.driver import CudaIpcDriver
    from vime.transport.weights.cuda_ipc.rank import CudaIpcSender
    from vime.config.train import WeightSyncConfig

    weights = {"model.embed_tokens.weight": torch.randn(64, 32, device="cuda"),
               "lm_head.weight": torch.randn(16, 32, device="cuda"),
               "model.norm.weight": torch.randn(32, device="cuda").bfloat16()}
    root = tmp_path / "root"
    driver, writer = CudaIpcDriver(DriverSetup(WeightSyncConfig(update_weight_dir=str(root)))), CudaIpcSender()
    handle = driver.prepare(version=1)
    writer.send(list(weights.items()), 0, handle)  # what a training writer does: stage_0.json in `handle`
    assert [p.name for p in Path(handle).iterdir()] == ["stage_0.json"]
    torch.save({k: v.cpu() for k, v in weights.items()}, tmp_path / "expected.pt")
    reader = textwrap.dedent(f"""
        import torch
        from vime.engine.in_vllm.cuda_ipc import open_ipc_tensors
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        got = dict(open_ipc_tensors({handle!r}, torch.cuda.current_device()))
        assert set(got) == set(expected)
        for name, tensor in got.items():
            assert tensor.is_cuda and torch.equal(tensor.cpu(), expected[name]), name
        try:
            open_ipc_tensors({str(tmp_path)!r}, torch.cuda.current_device())  # outside the weight root
        except PermissionError:
            print("ok")
    """)
    env = {**os.environ, WEIGHT_ROOT_ENV: str(root), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    driver.cleanup(handle)
    assert not Path(handle).exists()
