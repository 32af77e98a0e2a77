"""Finding the stack's processes, to prove none outlives a run."""

from __future__ import annotations

import subprocess

MARKERS = ("vllm.entrypoints.openai.api_server", "vime.backends.vllm_utils.router", "VLLM::EngineCore", "vllm::router")


def stack_pids() -> set[int]:
    """PIDs of engine servers, vLLM engine cores and routers on this machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if any(m in cmd for m in MARKERS):
            pids.add(int(pid))
    return pids


def worker_cpus() -> list[set[int]]:
    """The CPUs each running vLLM worker process may run on."""
    import psutil

    out = []
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "VLLM::Worker":
            try:
                out.append(set(proc.cpu_affinity()))
            except psutil.Error:
                pass
    return out
