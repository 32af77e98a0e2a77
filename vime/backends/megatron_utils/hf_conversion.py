"""HF (Qwen2 / Qwen3 / Llama / Qwen3-MoE) <-> Megatron-core GPTModel weights, with tensor-, pipeline- and
expert-parallel sharding.

Layout facts (megatron-core 0.16.1, local layer spec; a naive q|k|v concat gives wrong logits):
- `linear_qkv` stacks, per KV group g, [q heads of g | k_g | v_g] (weight [G*(H/G+2)*D, hidden], bias alike);
  TP ranks hold contiguous row blocks of that interleaved tensor.
- `linear_fc1` is [gate; up]; TP rank r holds [gate_r; up_r] (each half split separately).
- Column-parallel (split rows): linear_qkv, linear_fc1, word embeddings, output layer.
  Row-parallel (split columns): linear_proj, linear_fc2. Norms are replicated.
- Local spec norms are `input_layernorm` / `pre_mlp_layernorm`; the TransformerEngine spec fuses them into
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (both are understood here).
- Module names use local layer indices; the global layer is `layer_number - 1`.
- Tied embeddings: with one pipeline stage the model has no output weight; with several, the last stage keeps
  a copy of the embedding as `output_layer.weight`, which HF does not store.
- MoE layers: `mlp.router.weight` is HF's `mlp.gate.weight` (replicated); expert-parallel rank r holds experts
  [r * E/EP, (r + 1) * E/EP) as `mlp.experts.local_experts.{local index}.linear_fc1/2`, each laid out like a
  dense MLP (fc1 = [gate; up]) and split over tensor parallel the same way (expert TP = TP).

Who calls it: the trainer (load at start, `iter_hf_weights` to stream weights to vLLM, `save_hf_checkpoint`),
the convert tools, the tests. The pure functions take state dicts; the model-level ones use `parallel_state`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from vime.backends.megatron_utils.arguments import hf_architecture

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class _Arch:
    num_layers: int
    heads: int
    groups: int
    head_dim: int
    tied: bool
    qk_norm: bool
    qkv_bias: bool
    moe_layers: tuple[int, ...] = ()  # per global layer: 1 = MoE, 0 = dense (empty: a dense model)
    num_experts: int = 0

    @classmethod
    def from_hf(cls, hf_config) -> "_Arch":
        a = hf_architecture(hf_config)
        return cls(a["num_layers"], a["num_attention_heads"], a["num_query_groups"], a["kv_channels"],
                   not a["untie_embeddings_and_output_weights"], a["qk_layernorm"], a["add_qkv_bias"],
                   tuple(a["moe_layer_freq"] or ()), a["num_experts"] or 0)

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and bool(self.moe_layers[layer])


@dataclass(frozen=True)
class _Param:
    """How one Megatron parameter maps to HF: kind is "copy", "qkv" or "fc1"; split_dim None = replicated."""
    kind: str
    hf_names: tuple[str, ...]
    split_dim: int | None


# Per-layer Megatron suffix -> (kind, HF suffixes under model.layers.{L}., TP split dim).
_LAYER_PARAMS = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",), None),  # TE spec
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight"), 0),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias"), 0),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",), 1),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",), None),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",), None),  # TE spec
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",), 1),
}
# MoE layers: the router, and each expert's MLP (local index -> global expert = EP rank * local count + index)
_MOE_PARAMS = {
    "mlp.router.weight": ("copy", ("mlp.gate.weight",), None),
    "linear_fc1.weight": ("fc1", ("gate_proj.weight", "up_proj.weight"), 0),
    "linear_fc2.weight": ("copy", ("down_proj.weight",), 1),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_TE_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                   "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _param_for(name: str, arch: _Arch, layer_offset: int, expert_offset: int = 0) -> _Param | None:
    """The HF mapping of a Megatron parameter name of a chunk; None for the tied copy of the embedding.
    `expert_offset`: the global index of this rank's first local expert."""
    m = _LAYER_RE.match(name)
    if m:
        prefix = f"model.layers.{int(m.group(1)) + layer_offset}."
        expert = _EXPERT_RE.match(m.group(2))
        if expert:
            kind, hf_suffixes, split_dim = _MOE_PARAMS[expert.group(2)]
            prefix += f"mlp.experts.{int(expert.group(1)) + expert_offset}."
        else:
            kind, hf_suffixes, split_dim = _MOE_PARAMS.get(m.group(2)) or _LAYER_PARAMS[m.group(2)]
        return _Param(kind, tuple(prefix + s for s in hf_suffixes), split_dim)
    if name == "embedding.word_embeddings.weight":
        return _Param("copy", ("model.embed_tokens.weight",), 0)
    if name == "decoder.final_layernorm.weight":
        return _Param("copy", ("model.norm.weight",), None)
    if name == "output_layer.weight":
        return None if arch.tied else _Param("copy", ("lm_head.weight",), 0)
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def _chunk_param_names(arch: _Arch, num_local_layers: int, pre_process: bool, post_process: bool,
                       layer_offset: int = 0, num_local_experts: int = 0) -> list[str]:
    """Megatron parameter names (local spec) of a chunk holding `num_local_layers` layers from `layer_offset`
    (MoE layers with `num_local_experts` experts each)."""
    suffixes = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight"]
    if arch.qkv_bias:
        suffixes.append("self_attention.linear_qkv.bias")
    if arch.qk_norm:
        suffixes += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    dense = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    moe = ["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                                   for e in range(num_local_experts) for k in (1, 2)]
    names = [f"decoder.layers.{i}.{s}" for i in range(num_local_layers)
             for s in suffixes + (moe if arch.is_moe(layer_offset + i) else dense)]
    if pre_process:
        names.insert(0, "embedding.word_embeddings.weight")
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if not arch.tied or not pre_process:
            names.append("output_layer.weight")
    return names


# ---- full (unsharded) Megatron tensor <-> HF tensors ----

def _to_full_megatron(p: _Param, hf: Mapping[str, torch.Tensor], arch: _Arch) -> torch.Tensor:
    if p.kind == "qkv":
        q, k, v = (hf[n] for n in p.hf_names)
        rest = q.shape[1:]
        per_group = [q.reshape(arch.groups, -1, *rest), k.reshape(arch.groups, -1, *rest),
                     v.reshape(arch.groups, -1, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if p.kind == "fc1":
        return torch.cat([hf[n] for n in p.hf_names], dim=0)
    return hf[p.hf_names[0]]


def _from_full_megatron(p: _Param, full: torch.Tensor, arch: _Arch) -> list[tuple[str, torch.Tensor]]:
    if p.kind == "qkv":
        rest = full.shape[1:]
        q_per_group = arch.heads // arch.groups * arch.head_dim
        q, k, v = full.reshape(arch.groups, -1, *rest).split([q_per_group, arch.head_dim, arch.head_dim], dim=1)
        return [(n, t.reshape(-1, *rest)) for n, t in zip(p.hf_names, (q, k, v))]
    if p.kind == "fc1":
        return list(zip(p.hf_names, full.chunk(2, dim=0)))
    return [(p.hf_names[0], full)]


def _tp_split(p: _Param, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if p.split_dim is None or tp_size == 1:
        return full
    if p.kind == "fc1":
        return torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(tp_size, dim=p.split_dim)[tp_rank]


def _tp_merge(p: _Param, shards: list[torch.Tensor]) -> torch.Tensor:
    if p.split_dim is None or len(shards) == 1:
        return shards[0]
    if p.kind == "fc1":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=p.split_dim)


# ---- state dicts ----

def _layer_range(arch: _Arch, pp_rank: int, pp_size: int) -> tuple[int, int]:
    if arch.num_layers % pp_size:
        raise ValueError(f"{arch.num_layers} layers do not split evenly over {pp_size} pipeline stages")
    per_stage = arch.num_layers // pp_size
    return pp_rank * per_stage, per_stage


def _hf_to_chunk(hf: Mapping[str, torch.Tensor], arch: _Arch, tp_rank: int, tp_size: int, layer_offset: int,
                 num_local_layers: int, pre_process: bool, post_process: bool, ep_rank: int = 0,
                 ep_size: int = 1) -> dict[str, torch.Tensor]:
    out = {}
    local_experts = arch.num_experts // ep_size
    for name in _chunk_param_names(arch, num_local_layers, pre_process, post_process, layer_offset, local_experts):
        p = _param_for(name, arch, layer_offset, ep_rank * local_experts)
        if p is None:  # last stage's copy of the tied embedding
            p = _Param("copy", ("model.embed_tokens.weight",), 0)
        out[name] = _tp_split(p, _to_full_megatron(p, hf, arch), tp_rank, tp_size)
    return out


def hf_to_megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], hf_config, tp_rank: int = 0,
                              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
                              ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron parameters (local-spec names, no `_extra_state`) of one rank's model chunk.

    Layers are split evenly over the `pp_size` stages, MoE experts evenly over the `ep_size` expert-parallel
    ranks. Tensors keep the HF dtype and may be views of the inputs. `hf_state_dict` only needs `__getitem__`
    (a lazy safetensors reader works).
    """
    arch = _Arch.from_hf(hf_config)
    offset, n_local = _layer_range(arch, pp_rank, pp_size)
    return _hf_to_chunk(hf_state_dict, arch, tp_rank, tp_size, offset, n_local, pp_rank == 0, pp_rank == pp_size - 1,
                        ep_rank, ep_size)


def megatron_to_hf_state_dict(megatron_state_dicts: list[Mapping[str, torch.Tensor]], hf_config, pp_rank: int = 0,
                              pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Full HF tensors of one pipeline stage from its TP shards (`megatron_state_dicts[r]` = TP rank r's chunk)
    on expert-parallel rank `ep_rank` (its experts; everything else is the same on every EP rank).

    Inverse of `hf_to_megatron_state_dict`: the union over stages (and EP ranks) is the HF state dict, bit for
    bit (`lm_head.weight` is absent for tied embeddings, as in HF checkpoints). `_extra_state` keys are ignored.
    """
    arch = _Arch.from_hf(hf_config)
    offset, _ = _layer_range(arch, pp_rank, pp_size)
    expert_offset = ep_rank * (arch.num_experts // ep_size)
    out = {}
    for name in megatron_state_dicts[0]:
        if name.endswith("_extra_state"):
            continue
        p = _param_for(name, arch, offset, expert_offset)
        if p is not None:
            out.update(_from_full_megatron(p, _tp_merge(p, [sd[name] for sd in megatron_state_dicts]), arch))
    return out


# ---- live models (inside initialised parallel groups) ----

def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk


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


def _gather_ep(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The same local expert's parameter from every expert-parallel rank (index = EP rank). Collective."""
    _, ep_size = _ep_rank_size()
    if ep_size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(ep_size)]
    dist.all_gather(out, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return out


def gather_tp_shards(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All TP ranks' shards of a parameter (index = TP rank), via all_gather on the TP group.

    Collective: every rank of the TP group must call it for the same parameter in the same order.
    """
    _, tp_size = _tp_rank_size()
    if tp_size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return shards


def iter_hf_weights(model_chunks: list[torch.nn.Module], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this rank's chunks, one Megatron parameter at a time.

    Collective over the TP group (gathers sharded parameters); every TP rank gets the full tensors, so any
    of them can send. Each pipeline stage yields only its own layers. Tensors are detached and may alias
    the parameters: copy them before the next optimizer step if they must outlive it. For weight sync to
    the rollout engines and for `save_hf_checkpoint`.
    """
    arch = _Arch.from_hf(hf_config)
    _, ep_size = _ep_rank_size()
    local_experts = arch.num_experts // ep_size
    for chunk in model_chunks:
        model = _unwrap(chunk)
        offset = _layer_offset(model)
        for name, param in model.named_parameters():
            # an expert's parameter: every EP rank holds its own experts under the same local names
            per_ep = _gather_ep(param.detach()) if ".local_experts." in name else [param.detach()]
            for ep_rank, tensor in enumerate(per_ep):
                p = _param_for(name, arch, offset, ep_rank * local_experts)
                if p is None:
                    continue
                shards = [tensor] if p.split_dim is None else gather_tp_shards(tensor)
                yield from _from_full_megatron(p, _tp_merge(p, shards), arch)


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

    arch = _Arch.from_hf(AutoConfig.from_pretrained(hf_dir))
    hf = _SafetensorsDir(hf_dir)
    tp_rank, tp_size = _tp_rank_size()
    ep_rank, ep_size = _ep_rank_size()
    for chunk in model_chunks:
        model = _unwrap(chunk)
        params = dict(model.named_parameters())
        expected = _hf_to_chunk(hf, arch, tp_rank, tp_size, _layer_offset(model), len(model.decoder.layers),
                                model.pre_process, model.post_process, ep_rank, ep_size)
        for name, local in _TE_FUSED_NORMS.items():  # TE spec: norms live inside the linear layers
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
    initialised = parallel_state.model_parallel_is_initialized()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if initialised else 0
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if initialised else 1
    writer = not initialised or (parallel_state.get_tensor_model_parallel_rank() == 0
                                 and parallel_state.get_data_parallel_rank() == 0)
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
