"""Reward worker processes: calls that hang are killed at their timeout, the workers replaced and counted, and no
process outlives the pool. Real processes; the stand-in functions live in a module written to tmp_path."""

import asyncio
import os
import resource
import time
from types import SimpleNamespace

import pytest

from vime.data.sample import Sample
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import take_counters
from vime.rollout.rm_hub.pool import close_reward_pool, reward_pool
from vime.rollout.vllm_rollout import _reward_one
from vime.rollout.worker_pool import WorkerCallError, WorkerDiedError, WorkerPool, WorkerTimeoutError

STAND_INS = """
import os, sys, time

def reward(args, sample):
    if sample.label == "hang":
        while True:
            time.sleep(1)
    return float(len(sample.response))

def chatty(x):
    print("this goes to stderr, not into the replies")
    return x + 1

def allocate(mb):
    return len(bytearray(mb << 20))

def die():
    os._exit(3)

def not_json():
    return object()
"""


def children_of(pid: int) -> set[int]:
    """Live (not zombie) child processes of `pid`, from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    (tmp_path / "pool_stand_ins.py").write_text(STAND_INS)
    monkeypatch.syspath_prepend(str(tmp_path))  # before any pool starts: workers inherit sys.path
    close_reward_pool()
    reset_rollout_context()
    yield "pool_stand_ins"
    close_reward_pool()


def test_200_hanging_rewards_do_not_stall_later_ones(stand_ins):
    before = children_of(os.getpid())
    timeout = 4.0
    args = SimpleNamespace(custom_rm_path=f"{stand_ins}.reward", custom_rm_in_workers=True, rm_num_workers=4,
                           rm_timeout=timeout, group_rm=False, rm_type=None)
    hanging = [Sample(index=i, response="x", label="hang") for i in range(200)]
    later = [Sample(index=1000 + i, response="y" * i, label="ok") for i in range(20)]

    async def score(samples, delay=0.0):
        await asyncio.sleep(delay)
        start = time.monotonic()
        await asyncio.gather(*(_reward_one(args, s) for s in samples))
        return time.monotonic() - start

    async def both():  # the later rewards arrive while the hanging ones hold every worker
        return await asyncio.gather(score(hanging), score(later, delay=timeout / 2))

    hanging_s, later_s = asyncio.run(both())
    # a thread pool would stay stuck for good; here the 200 fail together, at the timeout, not 200 / 4 timeouts
    assert hanging_s < timeout + 2.0
    assert {s.metadata["failure"]["reason"] for s in hanging} == {"timeout"}
    assert all(s.status == Sample.Status.FAILED for s in hanging)
    assert later_s < timeout
    assert [s.reward for s in later] == [float(i) for i in range(20)]

    pool = reward_pool(args)
    assert pool.replaced >= 4  # every worker a hanging call held was killed and replaced...
    assert take_counters()["rollout/reward_workers_replaced"] == pool.replaced  # ...and counted
    assert len(pool.started_pids) == 4 + pool.replaced
    killed, serving = pool.started_pids[:-4], pool.started_pids[-4:]
    assert_gone(killed)
    assert children_of(os.getpid()) - before == set(serving)
    close_reward_pool()
    assert_gone(serving)
    assert children_of(os.getpid()) == before


@pytest.fixture
def pool(stand_ins):
    replaced = []
    pool = WorkerPool(1, memory_mb=512, on_replace=lambda: replaced.append(1))
    pool.replaced_calls = replaced
    yield pool
    pool.close()
    assert_gone(pool.started_pids)


def test_prints_do_not_corrupt_replies_and_errors_name_the_function(pool):
    assert pool.call("pool_stand_ins.chatty", 1, timeout=30) == 2
    with pytest.raises(WorkerCallError, match="pool_stand_ins.not_json raised TypeError: .*cannot be sent back as "
                                              "JSON"):
        pool.call("pool_stand_ins.not_json", timeout=30)
    with pytest.raises(WorkerCallError, match="must be importable in a fresh process"):
        pool.call("__main__.reward", timeout=30)
    assert pool.replaced == 0  # a function's error does not cost its worker


def test_memory_cap_and_crash_fail_the_call_only(pool):
    with pytest.raises(WorkerCallError, match="raised MemoryError"):
        pool.call("pool_stand_ins.allocate", 1024, timeout=30)  # over the 512 MiB cap
    assert pool.call("pool_stand_ins.allocate", 16, timeout=30) == 16 << 20
    with pytest.raises(WorkerDiedError, match=r"exited \(code 3\)"):
        pool.call("pool_stand_ins.die", timeout=30)
    assert pool.replaced == 1 and pool.replaced_calls == [1]
    assert pool.call("pool_stand_ins.chatty", 41, timeout=30) == 42  # served by the replacement


def test_a_call_past_its_timeout_kills_its_worker(pool):
    first = pool.started_pids[0]
    with pytest.raises(WorkerTimeoutError, match=f"ran past its 1s timeout; its worker process {first} was killed"):
        asyncio.run(pool.acall("time.sleep", 60, timeout=1.0))
    assert_gone([first])
    assert pool.call("os.getpid", timeout=30) == pool.started_pids[1]


def test_bad_pool_size_names_the_flag():
    close_reward_pool()
    with pytest.raises(ValueError, match="--rm-num-workers 0 must be >= 1"):
        reward_pool(SimpleNamespace(rm_num_workers=0))


def test_a_pool_works_when_its_pipes_are_numbered_past_1024(stand_ins):
    # a long-lived process (a Ray actor, this test session) holds many descriptors; select() refuses any >= 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        pool = WorkerPool(1)
        try:
            assert pool.call("pool_stand_ins.chatty", 1, timeout=30) == 2
            assert asyncio.run(pool.acall("pool_stand_ins.chatty", 2, timeout=30)) == 3
        finally:
            pool.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
