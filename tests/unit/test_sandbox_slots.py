"""Uid slots for sandboxes run by root: one uid per running sandbox across processes, never an account's uid,
and nothing of a slot's uid left running once the slot is released."""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
import sys

import pytest

from vime.agents.sandbox.slots import UidPool, check_unused_ids, uid_processes

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="uid slots are for root")


def test_uids_of_accounts_are_refused():
    account = next(e for e in pwd.getpwall() if e.pw_uid > 0)
    with pytest.raises(ValueError, match="belongs to (user|group) "):
        check_unused_ids(account.pw_uid, 1)
    with pytest.raises(ValueError, match="not a range of unprivileged uids"):
        check_unused_ids(2**32 - 4, 10)


@needs_root
def test_slots_are_exclusive_across_processes_and_emptied_on_release():
    base = 2**30 + 7000  # a range of its own: sandboxes of tests running beside this one are not disturbed
    pool = UidPool(base=base, count=2)

    async def main():
        first = await pool.acquire()
        # another process takes the other slot: flock is held across processes
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                                   f"fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                                   "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(30)",
                                   os.path.join(pool.dir, f"{base + 1}.lock")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "held\n"
        try:
            with pytest.raises(asyncio.TimeoutError):  # both slots taken: a third sandbox waits
                await asyncio.wait_for(pool.acquire(), timeout=0.3)
        finally:
            holder.kill()
            holder.wait()
        second = await asyncio.wait_for(pool.acquire(), timeout=5)
        assert {first.uid, second.uid} == {base, base + 1}
        # a process of the slot's uid that escaped its run (setsid, reparented) dies when the slot is released
        stray = subprocess.Popen(["sleep", "60"], user=second.uid, group=second.gid, extra_groups=[],
                                 start_new_session=True)
        assert uid_processes(second.uid) == [stray.pid]
        await pool.release(second)
        assert stray.wait(timeout=5) == -9 and uid_processes(second.uid) == []
        await pool.release(first)

    asyncio.run(main())
