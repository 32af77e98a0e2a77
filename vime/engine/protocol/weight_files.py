"""Where engines may read weight updates from, and what an update directory holds.

The writers (the driver makes each update's directory, a training rank writes the files) and the reader in the
engine (`vime.engine.in_vllm.weight_loading.update_files`, which refuses any other path or name) use these names.
"""

from __future__ import annotations

import os
import re
import tempfile


WEIGHT_ROOT_ENV = "VIME_WEIGHT_ROOT"  # the engine's weight root (`engine.engine_env`)
STAGE_FILE = re.compile(r"model-pp(\d+)\.safetensors")  # disk, delta: HF tensors of one pipeline stage
MANIFEST = re.compile(r"stage_(\d+)\.json")  # cuda_ipc: one pipeline stage's handles
ENGINE_DIR = re.compile(r"engine_(\d+)")  # cuda_ipc: one engine's manifests, when several engines read an update
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # lora_adapter: an adapter's directory


def stage_file(stage: int) -> str:
    return f"model-pp{stage}.safetensors"


def manifest(stage: int) -> str:
    return f"stage_{stage}.json"


def engine_dir(index: int) -> str:
    return f"engine_{index}"


def default_weight_root() -> str:
    """This user's own directory on /dev/shm (in memory), else in the temp dir: both are shared by every user,
    so the root is per user and private (`weight_transport.staging.stage_dir` checks that)."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"vime-{os.getuid()}")


def weight_root(update_weight_dir: str | None) -> str:
    """The one directory weight updates are staged under and engines load from: `update_weight_dir`
    (--update-weight-dir), else `default_weight_root()`; absolute, since the engines do not share the driver's
    working directory."""
    return os.path.abspath(update_weight_dir or default_weight_root())
