"""The driver's half of the disk transport: a fresh update directory, the worker call that loads it."""

from __future__ import annotations

import shutil

from vime.backends.weight_transport.base import TransportDriver
from vime.backends.weight_transport.staging import stage_dir
from vime.engine_protocol.weight_files import weight_root


class DiskDriver(TransportDriver):
    update_is_recovery_copy = True

    def __init__(self, args):
        from vime.backends.vllm_utils.engine import has_vime_worker_extension

        super().__init__(args)
        self.root = weight_root(args)
        # vime's loader (in place where it can), else vLLM's own reload (external engines, another extension)
        self.load_method = "vime_load_weights" if has_vime_worker_extension(args) else "reload_weights"

    def prepare(self, version: int) -> str:
        return stage_dir(self.root, f"vime_weights_{version}_")

    def load_call(self, path: str) -> tuple[str, dict[str, str]]:
        """The worker call that loads the HF safetensors directory `path`."""
        if self.load_method == "vime_load_weights":
            return self.load_method, {"path": path}
        return self.load_method, {"weights_path": path}

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: self.load_call(handle) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)
