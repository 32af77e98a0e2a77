"""Weight sync through files: each pipeline stage writes its layers as HF safetensors, engines reload them.

Works everywhere (CPU, GPU, engines on other machines with a shared mount). The default root on /dev/shm keeps it
in memory on one machine. Each update is a fresh private directory under the weight root
(`staging.stage_dir`) holding model-pp<stage>.safetensors files only; the engines load nothing else from it
(`vime.in_vllm.weight_loading.update_files`).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from vime.backends.weight_transport.base import Weights, WeightTransport, tensor_bytes
from vime.backends.weight_transport.staging import stage_dir, write_new_file
from vime.engine_protocol.weight_files import stage_file, weight_root

# torch dtype -> safetensors dtype name (the format's spec); a dtype not here cannot be written
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class DiskWeightTransport(WeightTransport):
    update_is_recovery_copy = True

    def __init__(self, args):
        from vime.backends.vllm_utils.engine import has_vime_worker_extension

        super().__init__(args)
        self.root = weight_root(args)
        # vime's loader (in place where it can), else vLLM's own reload (external engines, another extension)
        self.load_method = "vime_load_weights" if has_vime_worker_extension(args) else "reload_weights"

    def prepare(self, version: int) -> str:
        return stage_dir(self.root, f"vime_weights_{version}_")

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


def write_stage_file(directory: Path, stage: int, weights: Weights) -> Path:
    """`weights` as directory/model-pp<stage>.safetensors, created new and renamed into place once complete."""
    return write_new_file(directory, stage_file(stage), lambda f: write_safetensors(f, weights))


def write_safetensors(f: BinaryIO, weights: Weights) -> None:
    """The safetensors format, streamed: a header of names, dtypes, shapes and byte ranges, then each tensor's
    bytes, one tensor at a time (safetensors' own writers take a path, or build the whole file in memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in weights:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: safetensors has no {t.dtype}; cast it to one of "
                            f"{sorted(map(str, SAFETENSORS_DTYPES))}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec's padding: the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)) + raw)
    for _, t in weights:
        for piece in tensor_bytes(t):
            f.write(piece)
