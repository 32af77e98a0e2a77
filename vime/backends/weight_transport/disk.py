"""Weight sync through files: each pipeline stage writes its layers as HF safetensors, engines reload them.

Works everywhere (CPU, GPU, engines on other machines with a shared mount). /dev/shm keeps it in memory on
one machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def default_weight_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class DiskWeightTransport:
    def __init__(self, args):
        from vime.backends.vllm_utils.engine import has_vime_worker_extension

        self.root = getattr(args, "update_weight_dir", None) or default_weight_dir()
        # vime's loader (in place where it can), else vLLM's own reload (external engines, another extension)
        self.load_method = "vime_load_weights" if has_vime_worker_extension(args) else "reload_weights"

    def prepare(self, version: int) -> str:
        path = Path(self.root) / f"vime_weights_{os.getpid()}_{version}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def send(self, trainer, handle: str) -> None:
        """Collective over training ranks: TP shards are gathered, one writer per pipeline stage."""
        from megatron.core import parallel_state
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in trainer.hf_weights()}
        if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            tmp = Path(handle) / f".model-pp{pp_rank}.safetensors.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(Path(handle) / f"model-pp{pp_rank}.safetensors")

    def load_call(self, path: str) -> tuple[str, dict[str, str]]:
        """The worker call that loads the HF safetensors directory `path`."""
        if self.load_method == "vime_load_weights":
            return self.load_method, {"path": path}
        return self.load_method, {"weights_path": path}

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: self.load_call(handle) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)
