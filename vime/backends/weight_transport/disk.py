"""Weight sync through files: each pipeline stage writes its layers as HF safetensors, engines reload them.

Works everywhere (CPU, GPU, engines on other machines with a shared mount). /dev/shm keeps it in memory on
one machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from vime.backends.weight_transport.base import Weights, WeightTransport


def default_weight_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class DiskWeightTransport(WeightTransport):
    update_is_hf_dir = True

    def __init__(self, args):
        from vime.backends.vllm_utils.engine import has_vime_worker_extension

        super().__init__(args)
        self.root = getattr(args, "update_weight_dir", None) or default_weight_dir()
        # vime's loader (in place where it can), else vLLM's own reload (external engines, another extension)
        self.load_method = "vime_load_weights" if has_vime_worker_extension(args) else "reload_weights"

    def prepare(self, version: int) -> str:
        path = Path(self.root) / f"vime_weights_{os.getpid()}_{version}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        """The writer of each pipeline stage saves its tensors as one safetensors file."""
        if stage is not None:
            write_stage_file(Path(handle), stage, weights)

    def load_call(self, path: str) -> tuple[str, dict[str, str]]:
        """The worker call that loads the HF safetensors directory `path`."""
        if self.load_method == "vime_load_weights":
            return self.load_method, {"path": path}
        return self.load_method, {"weights_path": path}

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: self.load_call(handle) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)


def write_stage_file(directory: Path, stage: int, weights: Weights) -> None:
    """`weights` as directory/model-pp<stage>.safetensors, renamed into place once complete."""
    from safetensors.torch import save_file

    tmp = directory / f".model-pp{stage}.safetensors.tmp"
    save_file({name: t.detach().contiguous().cpu() for name, t in weights}, str(tmp))
    tmp.replace(directory / f"model-pp{stage}.safetensors")
