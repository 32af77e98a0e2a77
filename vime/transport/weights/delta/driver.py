"""The driver's half of the delta transport: disk's update directory, keyed by the engine set (a new set means
the engines' weights are unknown, and the writers send everything)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from vime.transport.weights.base import DriverSetup
from vime.transport.weights.broadcast.driver import engine_set_key
from vime.transport.weights.disk.driver import DiskDriver


class DeltaDriver(DiskDriver):
    update_is_recovery_copy = False  # a handle holds only what changed

    def __init__(self, setup: DriverSetup = DriverSetup()):
        super().__init__(setup)
        self.engine_set: dict = {}  # the engine set of the coming update and its key

    def connect(self, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]] | None = None) -> None:
        """Before `prepare`: a new engine set means the engines' weights are unknown."""
        engine_set_key(self.engine_set, engine_urls)

    def prepare(self, version: int) -> dict:
        if not self.engine_set:
            raise RuntimeError("DeltaDriver.connect(engine_urls) must run first")
        return {"dir": super().prepare(version), "key": self.engine_set["key"]}

    def load_calls(self, engine_urls: list[str], handle: dict) -> dict:
        if not any(Path(handle["dir"]).glob("*.safetensors")):  # no file: nothing changed, nothing to reload
            return {}
        return super().load_calls(engine_urls, handle["dir"])

    def cleanup(self, handle: dict) -> None:
        super().cleanup(handle["dir"])
