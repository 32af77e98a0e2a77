"""CUDA IPC weight handles (colocated GPUs): a second process maps the trainer's tensors without a copy through
the host. Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_ipc_handles_open_in_another_process(tmp_path):
    from torch.multiprocessing.reductions import reduce_tensor

    from vime.backends.weight_transport.cuda_ipc import encode_rebuild_args

    weights = {"model.embed_tokens.weight": torch.randn(64, 32, device="cuda"),
               "lm_head.weight": torch.randn(16, 32, device="cuda")}
    (tmp_path / "stage_0.json").write_text(json.dumps(  # what CudaIpcWeightTransport.send writes
        [{"name": name, "args": encode_rebuild_args(reduce_tensor(t))} for name, t in weights.items()]))
    torch.save({k: v.cpu() for k, v in weights.items()}, tmp_path / "expected.pt")
    reader = textwrap.dedent(f"""
        import torch
        from vime.backends.weight_transport.cuda_ipc import open_ipc_tensors
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        got = dict(open_ipc_tensors({str(tmp_path)!r}, torch.cuda.current_device()))
        assert set(got) == set(expected)
        for name, tensor in got.items():
            assert tensor.is_cuda and torch.equal(tensor.cpu(), expected[name]), name
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
