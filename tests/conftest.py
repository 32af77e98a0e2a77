"""Shared fixtures: tiny models and prompt data are built locally, never downloaded."""

from __future__ import annotations

import gc
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
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> tuple[Path, Path]:
    from vime.synthetic.arithmetic_data import write_arithmetic_data

    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), n_train=64, n_eval=16, seed=0)


_gloo_threads_after_collection = [0]


def _gloo_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith("gloo")
        except OSError:  # ended meanwhile
            pass
    return count


@pytest.fixture(autouse=True)
def _collect_torn_down_models():
    """Collect after a test that left gloo threads behind. A torn-down Megatron model is a reference cycle, freed
    only by a collection, which in a process this big comes rarely; until then each of its ~15 gloo groups keeps an
    event-loop thread (~0.2% of a core, idle) and its sockets: 150-260 threads and over 1024 descriptors built up
    over the suite. A full collection costs ~1 s in the suite's process, so only every other model or so."""
    yield
    if not os.path.isdir("/proc/self/task"):
        return
    if _gloo_threads() > _gloo_threads_after_collection[0] + 30:  # about two models' groups
        gc.collect()
        _gloo_threads_after_collection[0] = _gloo_threads()


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown once pytest has reported. CI saw this process die with SIGSEGV
    (exit 139) after "401 passed": a native library (Ray's core worker, vLLM/torch extensions imported by the
    tests) crashing in its destructors at exit, which would turn a green run red. Every result is already
    printed; the exit status is pytest's own."""
    if _exit_status and os.environ.get("VIME_TEST_FULL_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])
