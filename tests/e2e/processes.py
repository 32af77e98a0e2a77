"""Finding the stack's processes, to prove none outlives a run."""

from __future__ import annotations

import subprocess

MARKERS = ("vllm.entrypoints.openai.api_server", "vime.engine.control.router", "VLLM::EngineCore", "vllm::router")


def stack_pids() -> set[int]:
    """PIDs of engine servers, vLLM engine cores and routers on this machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if any(m in cmd for m in MARKERS):
            pids.add(int(pid))
    return pids


def engine_compute_processes(under: int | None = None) -> list:
    """The processes that run a vLLM model on this machine (or, given `under`, below that process: one engine's):
    worker processes, and engine cores that run their one worker inside (`engine.single_worker_env`)."""
    import psutil

    found = []
    candidates = psutil.process_iter(["name"]) if under is None else psutil.Process(under).children(recursive=True)
    # the kernel keeps 15 characters of a name ("VLLM::EngineCor"); psutil reads the rest from the command line,
    # and keeps the short one when that read fails (a process busy renaming itself, or exiting)
    for proc in candidates:
        try:
            name = proc.name() or ""
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


def vllm_process_names() -> list[str]:
    """Name and command line of every process that looks like vLLM's (what a failed `worker_cpus` saw)."""
    out = subprocess.run(["ps", "-eo", "pid=,comm=,args="], capture_output=True, text=True).stdout
    return [line.strip()[:160] for line in out.splitlines() if "vllm" in line.lower()]

