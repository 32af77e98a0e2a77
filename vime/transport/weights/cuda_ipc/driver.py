"""The driver's half of the cuda_ipc transport: an update directory (with a subdirectory per engine when there
are several), each engine's load call."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vime.engine.protocol.weight_files import engine_dir, weight_root
from vime.transport.weights.base import DriverSetup, TransportDriver
from vime.transport.weights.staging import stage_dir


class CudaIpcDriver(TransportDriver):
    def __init__(self, setup: DriverSetup = DriverSetup()):
        self.root = weight_root(setup.weight_sync.update_weight_dir)
        self.engine_urls: list[str] = []  # the engines the next update is for (`connect`)

    def connect(self, engine_urls: list[str], trainer_address) -> None:
        self.engine_urls = list(engine_urls)

    def prepare(self, version: int) -> str:
        """A new update directory; with several engines, an empty engine_<i>/ in it for each (`connect`'s order)."""
        path = stage_dir(self.root, f"vime_ipc_{version}_")
        if len(self.engine_urls) > 1:
            for i in range(len(self.engine_urls)):
                os.mkdir(Path(path) / engine_dir(i), 0o700)
        return path

    def bound_engines(self, handle: str) -> list[str] | None:
        """Exports per engine: those `connect` named (an engine restarted since loads the recovery copy)."""
        return list(self.engine_urls) if len(self.engine_urls) > 1 else None

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        if len(self.engine_urls) <= 1:
            return {url: ("vime_load_ipc_weights", {"path": handle}) for url in engine_urls}
        unknown = [u for u in engine_urls if u not in self.engine_urls]
        if unknown:  # its exports would be another engine's: torch's count of them would never reach 0
            raise ValueError(f"cuda_ipc: engines {unknown} are not among those this update was exported for "
                             f"({self.engine_urls})")
        return {url: ("vime_load_ipc_weights", {"path": str(Path(handle) / engine_dir(self.engine_urls.index(url)))})
                for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)
