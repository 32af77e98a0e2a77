"""Finding the stack's processes, to prove none outlives a run."""

from __future__ import annotations

import os
import subprocess

MARKERS = ("vllm.entrypoints.openai.api_server", "vime.backends.vllm_utils.router", "VLLM::EngineCore", "vllm::router")
# scripts/test.sh runs two lanes of tests side by side, each with its name here: a lane looks at the processes
# started under its own name only (every process of a run inherits it: the driver, Ray, engines, routers)
LANE_ENV = "VIME_TEST_LANE"


def in_this_lane(pid: int) -> bool:
    """Whether process `pid` was started by this lane's tests (always, when lanes are not used): the lane named
    in its environment, or else in its nearest ancestor's that names one (a process that renames itself, as
    vLLM's engine core and the router do, overwrites part of what /proc shows of its environment). A process
    of no lane counts as this lane's."""
    lane = os.environ.get(LANE_ENV)
    if lane is None:
        return True
    prefix = f"{LANE_ENV}=".encode()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                named = [v for v in f.read().split(b"\0") if v.startswith(prefix)]
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # the field after the state
        except (OSError, ValueError, IndexError):
            return True
        if named:
            return named[0] == prefix + lane.encode()
        pid = parent
    return True


def stack_pids() -> set[int]:
    """PIDs of this lane's engine servers, vLLM engine cores and routers on this machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if any(m in cmd for m in MARKERS) and in_this_lane(int(pid)):
            pids.add(int(pid))
    return pids


def engine_compute_processes() -> list:
    """The processes that run a vLLM model on this machine: worker processes, and engine cores that run their one
    worker inside (`engine.single_worker_env`)."""
    import psutil

    found = []
    # the kernel keeps 15 characters of a name ("VLLM::EngineCor"); psutil reads the rest from the command line,
    # and keeps the short one when that read fails (a process busy renaming itself, or exiting)
    for proc in psutil.process_iter(["name"]):
        try:
            name = proc.info["name"] or ""
            if not in_this_lane(proc.pid):
                continue
            if name.startswith("VLLM::Worker") or (
                    name.startswith("VLLM::EngineCor")
                    and not any(c.name().startswith("VLLM::Worker") for c in proc.children())):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def worker_cpus() -> list[set[int]]:
    """The CPUs each running vLLM model computes on (its main thread, which OpenMP binds with its team)."""
    import psutil

    out = []
    for proc in engine_compute_processes():
        try:
            out.append(set(proc.cpu_affinity()))
        except psutil.Error:
            pass
    return out
