"""Shared fixtures: tiny models and prompt data are built locally, never downloaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from vime.tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> tuple[Path, Path]:
    from vime.tools.arithmetic_data import write_arithmetic_data

    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), n_train=64, n_eval=16, seed=0)
