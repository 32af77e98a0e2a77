"""HF checkpoints and live Megatron models: load an HF checkpoint into this rank's model chunks, stream the
model's weights out under HF names (weight sync, export), save an HF checkpoint.

The name and layout mapping, and the tensor-, pipeline- and expert-parallel sharding, are the pure functions of
`hf_conversion`; this module adds what needs `parallel_state`: gathering shards over the TP and EP groups and
writing files on one rank per stage. Who calls it: the trainer, the convert scripts, the tests.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from vime.trainer.megatron.hf_conversion import (
    TE_FUSED_NORMS,
    Arch,
    from_full_megatron,
    hf_to_chunk,
    is_routed_expert,
    param_for,
    tp_merge,
)
from vime.trainer.megatron.hf_architecture import multi_token_prediction_layers
from vime.trainer.megatron.multi_token_prediction import mtp_layers
from vime.trainer.megatron.lora import is_lora_parameter, merged_weight

logger = logging.getLogger(__name__)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk


def _named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters (LoRA adapters left out: they are not the HF checkpoint's), and the buffers that
    are part of the checkpoint: the MoE router's expert bias (DeepSeek-V3's e_score_correction_bias, updated
    after each step without a gradient)."""
    yield from ((n, p) for n, p in model.named_parameters() if not is_lora_parameter(n))
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith(".router.expert_bias"))


def _policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`_named_weights` with each LoRA adapter merged into its base weight: the weights the policy computes with."""
    adapted = {name: m for name, m in model.named_modules() if hasattr(m, "lora")}
    for name, tensor in _named_weights(model):
        owner, _, leaf = name.rpartition(".")
        yield name, merged_weight(adapted[owner]) if leaf == "weight" and owner in adapted else tensor


def _layer_offset(model: torch.nn.Module) -> int:
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _tp_rank_size() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _ep_rank_size() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _etp_rank_size() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size())


def _all_gather(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group())
    return out


def _gather_ep(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The same local expert's parameter from every expert-parallel rank (index = EP rank). Collective."""
    return _all_gather(tensor, _ep_rank_size()[1], parallel_state.get_expert_model_parallel_group)


def gather_tp_shards(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All TP ranks' shards of a parameter (index = TP rank), via all_gather on the TP group.

    Collective: every rank of the TP group must call it for the same parameter in the same order.
    """
    return _all_gather(tensor, _tp_rank_size()[1], parallel_state.get_tensor_model_parallel_group)


def iter_hf_weights(model_chunks: list[torch.nn.Module], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this rank's chunks, one Megatron parameter at a time.

    Collective over the TP group (gathers sharded parameters); every TP rank gets the full tensors, so any
    of them can send. Each pipeline stage yields only its own layers. Tensors are detached and may alias
    the parameters: copy them before the next optimizer step if they must outlive it. For weight sync to
    the rollout engines and for `save_hf_checkpoint`.
    """
    _, ep_size = _ep_rank_size()
    for chunk in model_chunks:
        model = _unwrap(chunk)
        arch = Arch.from_hf(hf_config, mtp_layers(model))
        local_experts = arch.num_experts // ep_size
        offset = _layer_offset(model)
        for name, param in _policy_weights(model):
            # an expert's parameter: every EP rank holds its own experts under the same local names
            expert = is_routed_expert(name)
            per_ep = _gather_ep(param.detach()) if expert else [param.detach()]
            for ep_rank, tensor in enumerate(per_ep):
                p = param_for(name, arch, offset, ep_rank * local_experts)
                if p is None:
                    continue
                # routed experts are split over expert tensor parallel, the rest over tensor parallel
                shards = [tensor] if p.split_dim is None else (
                    _all_gather(tensor, _etp_rank_size()[1], parallel_state.get_expert_tensor_parallel_group)
                    if expert else gather_tp_shards(tensor))
                yield from from_full_megatron(p, tp_merge(p, shards, arch), arch)


class _SafetensorsDir(Mapping):
    """Lazy read-only mapping over the *.safetensors files of an HF directory (sharded or not)."""

    def __init__(self, hf_dir: str | Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            files = {n: hf_dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = {}
            for path in sorted(hf_dir.glob("*.safetensors")):
                with safe_open(path, framework="pt") as f:
                    files.update({n: path for n in f.keys()})
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {hf_dir}")
        self._files = files

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"{name!r} is not in the HF checkpoint")
        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self):
        return len(self._files)


def load_hf_checkpoint_into_model(model_chunks: list[torch.nn.Module], hf_dir: str | Path) -> None:
    """Copy the HF weights in `hf_dir` into this rank's chunks (in place, casting to the parameter dtype).

    Reads only the tensors this rank needs. Works on DDP-wrapped chunks. Raises if a model parameter has no
    HF source or a shape differs.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    held = max(mtp_layers(_unwrap(c)) for c in model_chunks)
    if multi_token_prediction_layers(config) > held:
        logger.info("%s: %d of the checkpoint's %d multi-token-prediction layer(s) (num_nextn_predict_layers) are "
                    "not loaded (--mtp-num-layers %d)", hf_dir, multi_token_prediction_layers(config) - held,
                    multi_token_prediction_layers(config), held)
    hf = _SafetensorsDir(hf_dir)
    tp_rank, tp_size = _tp_rank_size()
    ep_rank, ep_size = _ep_rank_size()
    for chunk in model_chunks:
        model = _unwrap(chunk)
        arch = Arch.from_hf(config, mtp_layers(model))
        params = dict(_named_weights(model))
        expected = hf_to_chunk(hf, arch, tp_rank, tp_size, _layer_offset(model), len(model.decoder.layers),
                                model.pre_process, model.post_process, ep_rank, ep_size, _etp_rank_size())
        for name, local in TE_FUSED_NORMS.items():  # TE spec: norms live inside the linear layers
            for key in [k for k in expected if k.endswith(name)]:
                fused = key[: -len(name)] + local
                if fused in params:
                    expected[fused] = expected.pop(key)
        if set(expected) != set(params):
            raise RuntimeError(f"model parameters and HF conversion disagree: model only "
                               f"{sorted(set(params) - set(expected))}, conversion only "
                               f"{sorted(set(expected) - set(params))}")
        with torch.no_grad():
            for name, tensor in expected.items():
                if params[name].shape != tensor.shape:
                    raise RuntimeError(f"{name}: model shape {tuple(params[name].shape)}, HF gives "
                                       f"{tuple(tensor.shape)}")
                params[name].copy_(tensor)


def copy_hf_metadata(hf_dir_src: str | Path, out_dir: str | Path) -> None:
    """Copy config, tokenizer, generation config and other non-weight files from `hf_dir_src` to `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(hf_dir_src).iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def stage_writer() -> tuple[int, int, bool]:
    """(pipeline rank, pipeline size, whether this rank writes its stage's file: TP rank 0 and DP rank 0)."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, True
    return (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0)


def save_hf_checkpoint(model_chunks: list[torch.nn.Module], hf_dir_src: str | Path, out_dir: str | Path) -> None:
    """Write this model as an HF checkpoint: safetensors plus config/tokenizer files copied from `hf_dir_src`.

    Collective: every training rank calls it; it returns once the checkpoint is complete. One pipeline
    stage writes `model.safetensors`; several write `model-0000{s}-of-0000{n}.safetensors` each plus
    `model.safetensors.index.json`. Only TP rank 0 and DP rank 0 of each stage write.
    """
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    tensors = {n: t.detach().cpu().contiguous() for n, t in iter_hf_weights(model_chunks,
                                                                            AutoConfig.from_pretrained(hf_dir_src))}
    pp_rank, pp_size, writer = stage_writer()
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        name = "model.safetensors" if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
        save_file(tensors, out_dir / name, metadata={"format": "pt"})
        if pp_rank == 0:
            copy_hf_metadata(hf_dir_src, out_dir)
    if dist.is_initialized():  # on return the checkpoint is complete, on every rank
        dist.barrier()
        if pp_size > 1:
            if dist.get_rank() == 0:
                _write_index(out_dir, pp_size)
            dist.barrier()


def save_peft_adapter(model_chunks: list[torch.nn.Module], config, base_model: str, out_dir: str | Path,
                      name: str) -> None:
    """The LoRA adapter `name` as PEFT saves it (`adapter_config.json`, `adapter_model.safetensors` with names
    `base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A/B.weight`), each tensor gathered over tensor
    parallel; `PeftModel.from_pretrained(base, out_dir)` loads it. Collective: every training rank calls it. With
    several pipeline stages each stage writes its part and the first rank joins them into the one file PEFT reads.
    Each file is written as a weight update's are (`staging.write_new_file`: new, complete before it has its
    name), since the adapter sync stages its updates with this too."""
    from vime.trainer.megatron.lora import adapted_linears, peft_config
    from vime.transport.weights.disk.rank import write_safetensors
    from vime.transport.weights.staging import write_new_file

    tensors = {}
    for chunk in model_chunks:
        for layer, hf_module, linear in adapted_linears(_unwrap(chunk)):
            adapters = linear.lora[name]
            for proj in adapters.A:
                a, b = adapters.A[proj].detach(), adapters.B[proj].detach()
                if adapters.row_parallel:  # each rank holds its columns of A, and all of B
                    a = torch.cat(gather_tp_shards(a), dim=1)
                else:  # each rank holds its rows of B, and all of A
                    b = torch.cat(gather_tp_shards(b), dim=0)
                prefix = f"base_model.model.model.layers.{layer}.{hf_module}.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = a.cpu().contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.cpu().contiguous()
    pp_rank, pp_size, writer = stage_writer()
    out_dir = Path(out_dir)
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        file_name = f"adapter_part-{pp_rank:05d}.safetensors" if pp_size > 1 else "adapter_model.safetensors"
        write_new_file(out_dir, file_name, lambda f: write_safetensors(f, list(tensors.items())))
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        if pp_size > 1:
            parts = sorted(out_dir.glob("adapter_part-*.safetensors"))
            joined = []
            for part in parts:
                with safe_open(part, framework="pt") as f:
                    joined += [(k, f.get_tensor(k)) for k in f.keys()]
            write_new_file(out_dir, "adapter_model.safetensors", lambda f: write_safetensors(f, joined))
            for part in parts:
                part.unlink()
        adapter_config = json.dumps(peft_config(config, base_model), indent=2).encode()
        write_new_file(out_dir, "adapter_config.json", lambda f: f.write(adapter_config))
    if dist.is_initialized():
        dist.barrier()


def _write_index(out_dir: Path, num_files: int) -> None:
    """HF's shard index: which file holds each tensor, and the total size in bytes."""
    weight_map, total = {}, 0
    for i in range(num_files):
        name = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        with safe_open(out_dir / name, framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                tensor_slice = f.get_slice(key)
                total += math.prod(tensor_slice.get_shape()) * _DTYPE_BYTES[tensor_slice.get_dtype()]
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
