"""scripts/gpu_check.sh on a machine without a GPU: every GPU test skips, the check passes and its JSON summary says
so, test by test. (On a GPU machine the script itself is the check: this test skips there.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu_check.sh itself")
def test_gpu_check_without_a_gpu_skips_everything_and_passes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_JSON", "PYTEST_ADDOPTS", "GPU_CHECK_WHEELS")}
    env["OUT"] = str(tmp_path)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "gpu_check: using " in proc.stdout  # it says which Python it runs
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.log").is_file()
    assert summary["ok"] is True and summary["gpu"]["count"] == 0 and summary["torch"]["cuda_available"] is False
    assert any("no GPU" in note for note in summary["notes"])
    assert isinstance(summary["vllm"]["version"], str) and summary["total_s"] > 0
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    assert sorted(summary["files"]) == files
    for file in files:
        mine = [t for t in summary["tests"] if t["file"] == file]
        assert mine, f"{file}: no test in the summary"
        assert all(t["outcome"] == "skipped" and t["reason"] for t in mine), mine
    assert summary["counts"]["skipped"] == len(summary["tests"]) > 0
