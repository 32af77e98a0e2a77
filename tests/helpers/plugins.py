"""A rollout plugin module written by a test: importable by name while the test runs, gone after, with the
rollout's process-wide state (GenerateState, the rollout context) fresh on both sides."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def rollout_plugin(tmp_path, monkeypatch, name: str, source: str):
    from vime.rollout.context import reset_rollout_context

    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    reset_rollout_context()  # a fresh one holds no generate state
    try:
        yield
    finally:
        reset_rollout_context()
        sys.modules.pop(name, None)


def run(coro):
    """Run a coroutine on vime's rollout loop (what the rollout manager does)."""
    from vime.utils.async_utils import run as run_on_loop

    return run_on_loop(coro)
