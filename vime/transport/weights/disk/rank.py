"""A training rank's half of the disk transport: the writer of each pipeline stage streams its tensors into one
safetensors file of the update directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO, Iterator

import torch

from vime.engine.protocol.weight_files import stage_file
from vime.transport.weights.base import Weights, WeightSender
from vime.transport.weights.staging import write_new_file

BYTE_CHUNK = 16 * 2**20

# torch dtype -> safetensors dtype name (the format's spec); a dtype not here cannot be written
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class DiskSender(WeightSender):
    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        """The writer of each pipeline stage saves its tensors as one safetensors file."""
        if stage is not None:
            write_stage_file(Path(handle), stage, weights)


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


def tensor_bytes(tensor: torch.Tensor, chunk: int = BYTE_CHUNK) -> Iterator[memoryview]:
    """A tensor's bytes (C order) as memoryviews of at most `chunk` bytes, copied through a buffer of this
    function's own; each view is valid until the next one. Never `tensor.numpy()`: numpy pins a CPU tensor's storage
    at its size for good, and --offload-train must later shrink the trainer's storages to zero."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() == 0:
        return
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.uint8)
    view = memoryview(scratch.numpy())
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        scratch[:n].copy_(flat[start:start + n])
        yield view[:n]
