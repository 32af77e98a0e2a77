"""New weights into a running vLLM model, in the engine's worker (called by
`vime.engine.in_vllm.worker_extension.WeightReceiver`).

vLLM's `reload_weights` handles every layer kind and quantization scheme: it moves each layer to the meta
device, buffers incoming tensors until a layer is complete (counting elements under a dispatch mode),
materialises the layer, loads it, runs its post-load processing and copies the result back into the original
storage. For an unquantized dense model on CPU most of that is bookkeeping: of a 1M-parameter reload (16.9 ms)
only the oneDNN repacking of the linear layers (5 ms) and the copies are work. `load_in_place` does that work
alone:

1. every linear layer whose dense weight vLLM's CPU kernels dropped after repacking gets a fresh dense parameter,
   made from the metadata vLLM recorded at model construction (shape, dtype, weight loader);
2. the model's own `load_weights` maps and shards the HF tensors into them (fused q/k/v and gate/up included);
3. each layer that received a tensor is processed again (`quant_method.process_weights_after_loading`: the
   repack into the kernel format); a layer that received nothing keeps its kernel, as with `reload_weights`.

Measured in-process on this CPU: 10.9 ms vs 17.1 ms (1M parameters), 34 ms vs 45 ms (20M). The dense parameters
of all layers exist at once, so past IN_PLACE_MAX_BYTES vLLM's layer-by-layer reload, which keeps one layer in
cache at a time, is the faster one (100M parameters, 382 MiB: 340-400 ms vs 440-660 ms in the engine). It returns
False, and touches nothing, where it does not apply (larger models, another platform, LoRA, quantized, MoE or
other special layers); the caller then uses `reload_weights`. Like `reload_weights`, a layer that receives only
part of its tensors would load garbage for the rest: vime's transports send whole layers (weight_transport.delta).

What a worker may read (`update_files`): only a directory under the run's weight root (`weight_files.weight_root`,
given to the engine as VIME_WEIGHT_ROOT by `engine.engine_env`; symlinks resolved), and in it only the file names
the writer uses (`vime.engine.protocol.weight_files`), each a regular file. The worker methods take a path from an
HTTP route, so a path elsewhere, or a file someone else put beside the weights, is refused instead of read.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV, default_weight_root

if TYPE_CHECKING:  # annotations only: `update_files` needs no torch (the API server's LoRA load uses it)
    import torch

ONLINE_LOADER = "online_process_loader"  # vLLM's layerwise-reload wrapper around a parameter's weight loader
IN_PLACE_MAX_BYTES = 128 * 2**20  # dense bytes made at once; beyond, vLLM's layer-by-layer reload is faster


def update_files(path: str, name: re.Pattern, root: str | None = None) -> list[Path]:
    """The files of the weight update directory `path`, sorted by the stage number `name` captures (by name when
    it captures none).

    Raises PermissionError unless `path` resolves to a directory inside `root` (default: $VIME_WEIGHT_ROOT, else
    `default_weight_root()`), and ValueError for any entry that is not a regular file named as `name` says (a
    planted file, a link): a writer's directory holds nothing else."""
    root = root or os.environ.get(WEIGHT_ROOT_ENV) or default_weight_root()
    real, real_root = Path(path).resolve(), Path(root).resolve()
    if real_root not in real.parents:
        raise PermissionError(f"weight path {path!r} (resolved: {real}) is outside the weight root {real_root}: "
                              f"engines load only what vime staged under --update-weight-dir (the engine's "
                              f"{WEIGHT_ROOT_ENV}); stage the weights there")
    if not real.is_dir():
        raise FileNotFoundError(f"weight directory {path!r} does not exist (or is not a directory)")
    files, unexpected = [], []
    for entry in sorted(real.iterdir()):
        match = name.fullmatch(entry.name)
        if match and stat.S_ISREG(entry.lstat().st_mode):
            files.append((int(match.group(1)) if name.groups else 0, entry))
        else:
            unexpected.append(entry.name)
    if unexpected:
        raise ValueError(f"weight directory {real} holds {unexpected}, which vime did not write there (it writes "
                         f"only files named {name.pattern!r}, no links): nothing was loaded; remove them, and check "
                         f"who else can write to {real_root}")
    if not files:
        raise FileNotFoundError(f"no weight files ({name.pattern!r}) in {real}")
    return [entry for _, entry in sorted(files)]


def load_in_place(vllm_config, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Load `weights` (HF names) into `model`; False, with `weights` untouched, where this path does not apply."""
    plan = _plan(vllm_config, model)
    if plan is None:
        return False
    kernels = []  # (layer, name, the kernel-format parameter the dense one stands in for)
    for layer, metas in plan:
        for name, meta in metas.items():
            kernels.append((layer, name, getattr(layer, name)))
            setattr(layer, name, _dense_parameter(meta, layer))
    try:
        loaded = model.load_weights(weights)
    except BaseException:
        # Put the kernel-format parameters back so that the layers stay consistent; parameters loaded in place
        # (norms, embeddings) may already hold new values, as with reload_weights: the update must be redone.
        for layer, name, kernel in kernels:
            setattr(layer, name, kernel)
        raise
    loaded_ids = {id(model.get_parameter(name)) for name in loaded}
    processed = set()
    for layer, _ in plan:
        if any(p is not None and id(p) in loaded_ids for p in layer._parameters.values()):
            layer.quant_method.process_weights_after_loading(layer)
            processed.add(id(layer))
    for layer, name, kernel in kernels:
        if id(layer) not in processed:
            setattr(layer, name, kernel)
    return True


@contextlib.contextmanager
def packing_cpu_experts(model: torch.nn.Module):
    """While vLLM's `reload_weights` runs in this context, every CPU MoE layer it reloads is padded and packed
    into the CPU kernel's layout before vLLM copies it back into the layer's storage; yields how many MoE layers
    can be.

    vLLM 0.32's unquantized MoE method runs the CPU experts' processing (`process_weights_after_loading` of the
    fused experts: zero-pad the expert MLP width to the kernel's alignment, then prepack) on the first load
    only. On a reload the fresh weights stay in checkpoint layout and unpadded, and vLLM copies them into the
    packed storage: the kernel then misreads them (measured: reloading a tiny Qwen3-MoE's own weights moved its
    log-probs by 0.2), and where the width needs padding (an expert width of 80: 160 rows of gate and up against
    192 stored) the copy fails and the update with it. A layer the update does not reach keeps its packed
    weights, untouched."""
    from vllm.platforms import current_platform

    methods = []
    if current_platform.is_cpu():
        for layer in model.modules():
            method = getattr(layer, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
                methods.append((method, experts))
    for method, experts in methods:
        def process(layer, _process=method.process_weights_after_loading, _experts=experts):
            _process(layer)
            _experts.process_weights_after_loading(layer)
        method.__dict__["process_weights_after_loading"] = process  # this instance only, for this reload
    try:
        yield len(methods)
    finally:
        for method, _ in methods:
            method.__dict__.pop("process_weights_after_loading", None)


def _plan(vllm_config, model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]] | None:
    """[(layer with a quant method, {parameter name: its construction metadata, for parameters the kernel
    dropped})], or None when some layer is not a plain unquantized linear/embedding layer, or the dropped
    parameters are more than IN_PLACE_MAX_BYTES."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or vllm_config.lora_config is not None \
            or vllm_config.model_config.quantization is not None:
        return None
    plan, dense_bytes = [], 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return None
        restore, _ = get_layerwise_info(layer).restore_metadata
        dropped = {}
        for name, param in layer._parameters.items():
            if param is not None and param.numel() == 0:
                meta = restore.get(name)
                if meta is None or meta.numel() == 0:
                    return None
                dropped[name] = meta
                dense_bytes += meta.numel() * meta.element_size()
        plan.append((layer, dropped))
    return plan if dense_bytes <= IN_PLACE_MAX_BYTES else None


def _dense_parameter(meta: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """A new uninitialised parameter like `meta` (class and attributes included), its weight loader bound to
    `layer` and unwrapped from any earlier layerwise reload."""
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    param = restore_layer_refs(materialize_meta_tensor(meta), layer)  # a copy: the metadata stays as it is
    loader = getattr(param, "weight_loader", None)
    while loader is not None and getattr(loader, "__name__", "") == ONLINE_LOADER:
        loader = loader.__wrapped__
    if loader is not None:
        param.weight_loader = loader
    return param
