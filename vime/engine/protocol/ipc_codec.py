"""CUDA IPC handles as JSON, not pickle: torch's `reduce_tensor` of a CUDA tensor gives the arguments of
`rebuild_cuda_tensor`; a training writer encodes them as plain data (handles as base64, dtypes and the few classes
torch puts there by name), an engine's worker decodes them, so reading a manifest runs no code. Both directions
live here, each the other's inverse (the cuda_ipc transport: `weight_transport.cuda_ipc`)."""

from __future__ import annotations

import base64

import torch

REBUILD_ARITY = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
STORAGE_CLASSES = (torch.UntypedStorage, torch.storage.TypedStorage)


def _classes() -> dict[str, type]:
    """The classes `reduce_tensor` puts in rebuild_cuda_tensor's arguments, by name: nothing else is accepted."""
    return {"torch.Tensor": torch.Tensor, "torch.nn.Parameter": torch.nn.Parameter,
            "torch.UntypedStorage": torch.UntypedStorage, "torch.storage.TypedStorage": torch.storage.TypedStorage}


def encode_rebuild_args(reduced) -> list:
    """torch's `reduce_tensor(t)` of a CUDA tensor -> JSON-able rebuild arguments (each value tagged with its kind)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, args = reduced
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"cuda_ipc sends CUDA tensors only; torch reduced one with {rebuild.__name__}")
    names = {cls: name for name, cls in _classes().items()}
    out = []
    for value in args:
        if isinstance(value, type):
            out.append(["class", names[value]])
        elif isinstance(value, torch.dtype):
            out.append(["dtype", str(value).removeprefix("torch.")])
        elif isinstance(value, bytes):
            out.append(["bytes", base64.b64encode(value).decode()])
        elif isinstance(value, tuple):  # torch.Size, strides
            out.append(["ints", [int(v) for v in value]])
        elif value is None or isinstance(value, (bool, int, float)):
            out.append(["plain", value])
        else:
            raise TypeError(f"cuda_ipc: unexpected {type(value).__name__} in torch's rebuild arguments")
    return out


def decode_rebuild_args(encoded: list) -> list:
    """Inverse of `encode_rebuild_args`; refuses any kind, class or argument list torch's would not have."""
    classes, out = _classes(), []
    for kind, value in encoded:
        if kind == "class":
            if value not in classes:
                raise KeyError(f"cuda_ipc: {value!r} is none of the classes torch's rebuild arguments hold")
            out.append(classes[value])
        elif kind == "dtype":
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"cuda_ipc: {value!r} is not a torch dtype")
            out.append(dtype)
        elif kind == "bytes":
            out.append(base64.b64decode(value, validate=True))
        elif kind == "ints":
            out.append(tuple(int(v) for v in value))
        elif kind == "plain" and (value is None or isinstance(value, (bool, int, float))):
            out.append(value)
        else:
            raise ValueError(f"cuda_ipc: unknown argument kind {kind!r} (or a {type(value).__name__} as plain)")
    if len(out) != REBUILD_ARITY or out[0] not in TENSOR_CLASSES or out[4] not in STORAGE_CLASSES \
            or not isinstance(out[5], torch.dtype):
        raise ValueError("cuda_ipc: not rebuild_cuda_tensor's arguments (tensor class, size, stride, offset, "
                         "storage class, dtype, device, handle, ...)")
    out[1] = torch.Size(out[1])  # tensor_size
    return out
