"""The driver's half of the LoRA adapter sync: a fresh update directory, the update call that serves each adapter
the trainers wrote there (also a restarted engine's recovery call: `engine_fleet.recovery_load_call`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from vime.engine.protocol.names import LOAD_ADAPTER
from vime.engine.protocol.weight_files import ADAPTER_FILES, weight_root
from vime.transport.weights.base import DriverSetup, TransportDriver
from vime.transport.weights.staging import stage_dir

PREFIX = "vime_lora_"  # of every update directory (the fleet deletes a recovery copy only by such a name)


def adapter_load_call(adapters: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The update call that serves each adapter directory of `adapters` ({name: directory}) as model `name`
    (`vime.engine.in_vllm.lora_serving.load_adapter`, inside the engine's update route)."""
    return LOAD_ADAPTER, dict(adapters)


def adapter_dirs(root: str | Path) -> dict[str, str]:
    """{adapter name: its directory} of an update directory (one subdirectory per adapter); {} if it holds none."""
    return {d.name: str(d) for d in sorted(Path(root).iterdir()) if (d / ADAPTER_FILES[0]).is_file()} \
        if Path(root).is_dir() else {}


class LoraAdapterDriver(TransportDriver):
    update_is_recovery_copy = True  # a restarted engine loads the base from its checkpoint, then this adapter

    def __init__(self, setup: DriverSetup = DriverSetup()):
        self.root = weight_root(setup.weight_sync.update_weight_dir)

    def prepare(self, version: int) -> str:
        return stage_dir(self.root, f"{PREFIX}{version}_")

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        adapters = adapter_dirs(handle)
        if not adapters:
            raise FileNotFoundError(f"LoRA update {handle}: the trainers wrote no adapter there")
        return {url: adapter_load_call(adapters) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        # the workers hold the adapter in memory now (one adapter, as many CPU slots as adapters: never evicted)
        shutil.rmtree(handle, ignore_errors=True)
