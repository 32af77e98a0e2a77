"""The CPUs a compute process (training rank, vLLM engine) uses, and setting a process up to use them.

`vime.driver.placement.Placement` decides each process's `CpuShare`: in the synchronous loop training and
generation take turns, so the training ranks on a node split all of its CPUs between them and so do the engines;
when the two phases overlap (train_async.py) the node is first cut between the training side and the engines, in
proportion to their shares, and each side splits its part.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuShare:
    """A process's CPUs: member `first`..`first + units` of `total` equal shares of its group's CPUs, where the
    group (the processes that compute at the same time and split a side of the node) holds units
    `group_first`..`group_first + group_units` of `group_total` of the node's CPUs, rounded to whole CPUs."""

    first: int = 0
    units: int = 1
    total: int = 1
    group_first: int = 0
    group_units: int = 1
    group_total: int = 1

    def cpus(self, allowed: list[int]) -> list[int]:
        """This share of `allowed` (the node's CPUs as the process sees them)."""
        return _members(_group(allowed, self.group_first, self.group_units, self.group_total),
                        self.first, self.units, self.total)


def _group(allowed: list[int], first: int, units: int, total: int) -> list[int]:
    """A group's whole CPUs, cut at the rounded proportional positions (groups never share a CPU); a group that
    rounds to none, on a node with fewer CPUs than groups, time-shares all of them."""
    start, end = (round(u * len(allowed) / total) for u in (first, first + units))
    return allowed[start:end] if end > start else list(allowed)


def _members(allowed: list[int], first: int, units: int, total: int) -> list[int]:
    """Units [first, first + units) of `total` equal shares of `allowed`: a contiguous run where there are at least
    as many CPUs as units (the first len % total units get one more), else one CPU per unit, round robin."""
    if not allowed:
        return []
    if total > len(allowed):
        return sorted({allowed[(first + k) % len(allowed)] for k in range(units)})
    size, extra = divmod(len(allowed), total)

    def start(unit: int) -> int:
        return unit * size + min(unit, extra)

    return allowed[start(first):start(first + units)]


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def use_cpus(cpus: list[int], threads: int | None = None, pin: bool = True) -> str:
    """Run this process's compute on `cpus`: pin it there (`pin`), size torch's and OpenMP's thread pools
    (`threads`, default one per CPU) and undo Ray's low worker priority where the OS allows it.
    Returns a line describing the result, for the start-up log."""
    import torch

    if pin and cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    threads = threads or max(1, len(cpus))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this one starts (checkpoint helpers)
    torch.set_num_threads(threads)
    return f"{torch.get_num_threads()} threads on CPUs {sorted(allowed_cpus())}, nice {raise_priority()}"


def raise_priority() -> int:
    """Ray starts workers at nice 15, below everything else on the node; compute processes want the default
    priority. Returns the niceness in force (lowering it needs CAP_SYS_NICE; without it the value stays)."""
    if not hasattr(os, "getpriority"):
        return 0
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            nice = 0
        except PermissionError:
            logger.warning("this compute process runs at nice %d and may not lower it; start Ray with "
                           "RAY_worker_niceness=0 in its environment so that it does not lose the CPU to idle work",
                           nice)
    return nice
