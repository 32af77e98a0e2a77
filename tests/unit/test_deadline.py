"""Blocking calls to actors have deadlines (`vime.utils.deadline.gather`), on a real local Ray: answers come back in
order, a member that fails fails the call at once although another hangs, and a call that never returns raises
DeadlineExceeded naming the call and the flag."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from vime.utils.deadline import DeadlineExceeded, gather  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
def _answer(value, delay: float = 0.0):
    time.sleep(delay)
    if isinstance(value, Exception):
        raise value
    return value


def test_gather_answers_in_order_and_fails_fast_and_by_name(local_ray):
    assert gather([_answer.remote(i, 0.2 * (3 - i)) for i in range(3)], "three calls", 30) == [0, 1, 2]
    assert gather(_answer.remote("one"), "one call", 30) == "one"
    assert gather([], "nothing", 1) == []

    hangs = _answer.remote(None, 3600)
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 broke"):
        gather([hangs, _answer.remote(RuntimeError("rank 1 broke"), 0.5)], "a collective", 60)
    assert time.monotonic() - start < 20  # not the hanging member's hour, not the 60 s deadline

    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"the actor ranks' save did not finish within 1.5s \(1 of 2 answers "
                                               r"missing\).*raise --train-timeout"):
        gather([_answer.remote(1), hangs], "the actor ranks' save", 1.5, "--train-timeout")
    assert 1.5 <= time.monotonic() - start < 15
    ray.cancel(hangs, force=True)

