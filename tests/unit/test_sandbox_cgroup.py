"""cgroup v2 for sandboxes: finding this process's cgroup, the reasons it cannot be used, and what a run writes.

The kernel part cannot be exercised where cgroup v2 has no memory/pids controllers (e.g. a hybrid v1 layout), so
the pool is driven over a directory tree laid out like cgroupfs; on a machine that has them, the last test runs
the real thing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from vime.agents.sandbox import LocalSandbox, SandboxLimits
from vime.agents.sandbox.cgroup import CgroupPool, CgroupUnavailable, cgroup_pool, cgroup_reason, own_cgroup_dir

MOUNTINFO = ("24 1 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
             "25 1 0:23 / /proc rw - proc proc rw\n")


def test_own_cgroup_dir_from_proc_files():
    assert own_cgroup_dir(MOUNTINFO, "0::/user.slice/job\n") == "/sys/fs/cgroup/user.slice/job"
    assert own_cgroup_dir(MOUNTINFO, "0::/\n") == "/sys/fs/cgroup"
    inner = "30 1 0:22 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"  # a bind-mounted subtree
    assert own_cgroup_dir(inner, "0::/docker/abc/run\n") == "/sys/fs/cgroup/run"
    with pytest.raises(CgroupUnavailable, match="no cgroup v2"):
        own_cgroup_dir("25 1 0:23 / /proc rw - proc proc rw\n", "0::/\n")
    with pytest.raises(CgroupUnavailable, match="cgroup v1 only"):
        own_cgroup_dir(MOUNTINFO, "4:memory:/x\n")


def _fake_cgroup(path: Path, controllers: str = "cpu memory pids", enabled: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text(enabled + "\n")
    return path


def test_pool_refuses_without_memory_and_pids(tmp_path):
    with pytest.raises(CgroupUnavailable, match="no memory/pids controller .*hugetlb"):
        CgroupPool(str(_fake_cgroup(tmp_path / "cg", controllers="hugetlb")))
    broken = _fake_cgroup(tmp_path / "busy")
    (broken / "cgroup.subtree_control").unlink()
    (broken / "cgroup.subtree_control").mkdir()  # unwritable, as cgroupfs answers a cgroup that holds processes
    with pytest.raises(CgroupUnavailable, match="cannot enable memory/pids for children"):
        CgroupPool(str(broken))


def test_pool_enables_controllers_and_limits_a_run(tmp_path):
    parent = _fake_cgroup(tmp_path / "cg", enabled="cpu")
    # cgroupfs makes a new cgroup's files itself; here the pool's directory gets them by hand
    _fake_cgroup(parent / "vime-sandbox-test")
    pool = CgroupPool(str(parent), name="vime-sandbox-test")
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (parent / "vime-sandbox-test" / "cgroup.subtree_control").read_text() == "+memory +pids"
    run = Path(pool.start_run("run-1", memory_bytes=3 * 2**20, pids=9))
    assert (run / "memory.max").read_text() == str(3 * 2**20) and (run / "pids.max").read_text() == "9"
    assert not pool.oom_killed(str(run))
    (run / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert pool.oom_killed(str(run))
    (run / "cgroup.kill").write_text("")
    asyncio.run(pool.end_run(str(run), timeout_s=0.1))
    assert (run / "cgroup.kill").read_text() == "1"


def test_the_report_says_whether_cgroups_are_used():
    report = LocalSandbox().isolation["cgroup"]
    if cgroup_pool() is None:
        assert report == f"off: {cgroup_reason()}" and cgroup_reason()
        return
    assert report.startswith("memory.max and pids.max per sandbox")
    two_of_700mb = ("import os, time\nos.fork()\nx = bytearray(700 * 2**20)\n"
                    "x[::4096] = b'1' * len(range(0, len(x), 4096))\ntime.sleep(2)")
    r = asyncio.run(LocalSandbox().run(code=two_of_700mb,
                                       limits=SandboxLimits(wall_time_s=10, memory_mb=1024, max_scratch_mb=1)))
    assert r.stopped_reason == "memory", r  # each under RLIMIT_AS (1 GiB), together over memory.max (1 GiB + 1 MiB)
    assert not [e for e in os.scandir(cgroup_pool().dir) if e.is_dir()]  # each run's cgroup is removed
