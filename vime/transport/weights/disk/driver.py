"""The driver's half of the disk transport: a fresh update directory, the worker call that loads it."""

from __future__ import annotations

import shutil

from vime.engine.protocol.weight_files import weight_root
from vime.transport.weights.base import DriverSetup, TransportDriver
from vime.transport.weights.staging import stage_dir


def load_call(path: str, vime_worker_extension: bool) -> tuple[str, dict[str, str]]:
    """The worker call that loads the HF safetensors directory `path`: vime's loader (in place where it can) on
    engines that run vime's worker methods, else vLLM's own reload (external engines, another extension)."""
    if vime_worker_extension:
        return "vime_load_weights", {"path": path}
    return "reload_weights", {"weights_path": path}


class DiskDriver(TransportDriver):
    update_is_recovery_copy = True

    def __init__(self, setup: DriverSetup = DriverSetup()):
        self.root = weight_root(setup.weight_sync.update_weight_dir)
        self.vime_worker_extension = setup.vime_worker_extension

    def prepare(self, version: int) -> str:
        return stage_dir(self.root, f"vime_weights_{version}_")

    def load_call(self, path: str) -> tuple[str, dict[str, str]]:
        """The worker call that loads the HF safetensors directory `path`."""
        return load_call(path, self.vime_worker_extension)

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: self.load_call(handle) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)
