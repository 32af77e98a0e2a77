"""LoRA adapters on Megatron-core's linear layers: the base frozen, only the adapters train.

Targets are HF projection names: q_proj, k_proj, v_proj (fused in Megatron's `linear_qkv`), o_proj
(`linear_proj`), gate_proj, up_proj (fused `linear_fc1`), down_proj (`linear_fc2`); "all-linear" is all seven.
Dense attention and MLP linears only: a targeted projection that a layer does not have (MoE experts, multi-latent
attention) gets no adapter there (logged once; a model part with none at all is refused); sequence parallel is
refused at the flags, TransformerEngine's norm-fused linears when the adapters are attached.

Each adapter is PEFT's: delta W = (alpha / r) * B @ A with A [r, in] (kaiming-uniform) and B [out, r] (zeros), so
a fresh adapter leaves the model's outputs unchanged. On a fused Megatron linear every HF projection keeps its
own A and B, and their outputs are laid out as the fused weight's rows are (`linear_qkv`: per KV group
[q heads | k | v]; `linear_fc1`: [gate; up]), which is what makes the adapters PEFT's, name for name.

Tensor parallel (each adapter split the way its base weight is):
- column-parallel (qkv, fc1): A replicated, B split by output rows. h = x A^T is the same on every rank; its
  gradient is summed over the ranks (each one's B sees only its rows) by `copy_to_tensor_model_parallel_region`.
- row-parallel (proj, fc2): A split by input columns, B replicated. h = x_local A_local^T is a partial sum,
  all-reduced forward (`reduce_from_tensor_model_parallel_region`) before B.
A is drawn whole from a generator seeded per run, layer and projection, and each rank keeps its slice, so any
layout starts from the same adapters as one process.

Multi-LoRA (--lora-adapters): every targeted linear holds one set of adapters per name (`LoraSet`), all trained
in the same steps on the one frozen base. A micro-batch may mix samples of several adapters: each token goes
through its own sample's adapter only (`routed`, given each token's adapter index by the schedule), so a sample's
log-probs are those of its adapter alone, and only its adapter gets its gradient. Without the flag the one
adapter is named "policy" (the served model's name).

Who calls it: the trainer's model preparation (`attach_lora` after the HF weights are loaded and before DDP wraps
the chunks, so only adapters get gradient buffers and optimizer state) and `hf_checkpoint.iter_hf_weights`
(`merged_weight`: what the engines and --save-hf get).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from vime.config.run import JobConfig
from vime.config.train import LoraConfig
from vime.engine.control.client import SERVED_MODEL
from vime.trainer.megatron.train_arguments import lora_targets
from vime.utils.lora_adapters import adapter_names

# Megatron module (under each decoder layer) -> the HF projections fused in it, in the order of its rows
_FUSED = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
          "self_attention.linear_proj": ("o_proj",),
          "mlp.linear_fc1": ("gate_proj", "up_proj"),
          "mlp.linear_fc2": ("down_proj",)}
_ROW_PARALLEL = {"self_attention.linear_proj", "mlp.linear_fc2"}
logger = logging.getLogger(__name__)
DEFAULT_ADAPTER = SERVED_MODEL  # the one adapter of a run without --lora-adapters, served as the policy itself


@dataclass(frozen=True)
class LoraSetup:
    """The LoRA a model is trained with: rank, scale, target projections and the adapters' names."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    seed: int = 0
    adapters: tuple[str, ...] = ()  # their names, in --lora-adapters order; () is the one DEFAULT_ADAPTER

    @property
    def names(self) -> tuple[str, ...]:
        return self.adapters or (DEFAULT_ADAPTER,)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_args(cls, args) -> LoraSetup | None:
        """None without --lora-rank."""
        lora = LoraConfig.of(args)
        job = JobConfig.of(args)
        if not lora.lora_rank:
            return None
        return cls(lora.lora_rank, float(lora.lora_alpha if lora.lora_alpha is not None else lora.lora_rank),
                   lora.lora_dropout, lora_targets(lora.lora_target_modules), job.seed, tuple(adapter_names(args)))


class LoraAdapters(torch.nn.Module):
    """The adapters of one Megatron linear: `A.<proj>` and `B.<proj>` per fused HF projection, this rank's
    slices. `rows` are the output rows of each projection on this rank, in order; `groups` (linear_qkv only)
    interleaves them per KV group as the fused weight does."""

    def __init__(self, config: LoraSetup, projections: tuple[str, ...], in_features: int, rows: tuple[int, ...],
                 row_parallel: bool, groups: int | None, seeds: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.projections, self.rows, self.row_parallel, self.groups = projections, rows, row_parallel, groups
        self.in_features = in_features  # this rank's input width (row-parallel: a slice)
        self.enabled = True
        self.scale = config.scale
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        tp_rank, tp_size = _tp()
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name, out_rows, seed in zip(projections, rows, seeds):
            if name not in config.targets:  # a fused projection left out (q and v without k): its rows get no delta
                continue
            full_in = in_features * tp_size if row_parallel else in_features
            a = torch.empty(config.rank, full_in, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
            if row_parallel:
                a = a.chunk(tp_size, dim=1)[tp_rank]
            self.A[name] = torch.nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
            # column-parallel: this rank's rows; row-parallel: B is replicated, all rows (the output is not split)
            self.B[name] = torch.nn.Parameter(torch.zeros(out_rows, config.rank, dtype=dtype, device=device))
        # the split ones (B column-parallel, A row-parallel) count on every rank in Megatron's grad norm, the
        # replicated ones on the first only
        split, split_dim = (self.A, 1) if row_parallel else (self.B, 0)
        for p in self.parameters():
            is_split = any(p is q for q in split.values())
            set_tensor_model_parallel_attributes(p, is_split and tp_size > 1, split_dim if is_split else -1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the base layer's output, for its input `x`."""
        x = self.dropout(x)
        outs = []
        for name, rows in zip(self.projections, self.rows):
            if name not in self.A:
                outs.append(x.new_zeros(*x.shape[:-1], rows))
                continue
            h = torch.matmul(x, self.A[name].t())
            h = reduce_from_tensor_model_parallel_region(h) if self.row_parallel else \
                copy_to_tensor_model_parallel_region(h)
            outs.append(torch.matmul(h, self.B[name].t()))
        return self._fuse(outs, dim=-1) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A laid out as this rank's shard of the base weight (for merged weights)."""
        with torch.no_grad():
            some = next(iter(self.A.values()))
            deltas = [self.B[n] @ self.A[n] if n in self.A else some.new_zeros(rows, self.in_features)
                      for n, rows in zip(self.projections, self.rows)]
            return self._fuse(deltas, dim=0) * self.scale

    def _fuse(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        if self.groups is None:  # linear_fc1: [gate; up]
            return torch.cat(parts, dim=dim)
        dim = dim % parts[0].dim()
        split = [p.reshape(*p.shape[:dim], self.groups, -1, *p.shape[dim + 1:]) for p in parts]
        fused = torch.cat(split, dim=dim + 1)
        return fused.reshape(*parts[0].shape[:dim], -1, *parts[0].shape[dim + 1:])


def _seed(run_seed: int, layer: int, projection: str, adapter: str) -> int:
    """The same in every process (Python's own hash of a string is not)."""
    digest = hashlib.sha256(f"{run_seed}/{layer}/{projection}/{adapter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _tp() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class LoraSet(torch.nn.ModuleDict):
    """The named adapters of one Megatron linear (`<linear>.lora.<name>.A.<proj>`): one per --lora-adapters entry,
    or the single adapter `DEFAULT_ADAPTER`. With several, each token goes through its own sample's adapter only:
    `route` holds, for the forward running now, each token's adapter index in the layout of the linear's input
    without its last dimension (set by `routed`)."""

    def __init__(self, adapters: dict[str, LoraAdapters]):
        super().__init__(adapters)
        self.enabled = True  # False while merged into the weight (`adapters_merged`)
        self.route: torch.Tensor | None = None

    @property
    def row_parallel(self) -> bool:
        return next(iter(self.values())).row_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapters = list(self.values())
        if len(adapters) == 1:
            return adapters[0](x)
        if self.route is None:
            raise RuntimeError("a forward through several LoRA adapters needs each token's adapter (lora.routed)")
        # every adapter runs on every rank (their tensor-parallel collectives must match); masks keep its tokens
        return sum(adapter(x) * (self.route == k).unsqueeze(-1).to(x.dtype) for k, adapter in enumerate(adapters))


def _add_adapters_hook(module, inputs, output):
    if not module.lora.enabled:  # merged into the weight for the moment (`adapters_merged`)
        return output
    out, bias = output
    return out + module.lora(inputs[0]), bias


def _adapted_modules(chunks) -> list[torch.nn.Module]:
    """The linears with adapters (`<linear>.lora` a LoraSet) of `chunks`."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "lora", None), LoraSet)]


@contextlib.contextmanager
def routed(chunk: torch.nn.Module, route: torch.Tensor | None):
    """Within the block (one micro-batch's forward through `chunk`), each token takes the adapter `route` gives it:
    [s, b] adapter indices, the layout of Megatron's hidden states (packed: [T, 1]). None: the one adapter."""
    modules = _adapted_modules([chunk]) if route is not None else []
    for m in modules:
        m.lora.route = route
    try:
        yield
    finally:
        for m in modules:
            m.lora.route = None


@contextlib.contextmanager
def adapters_merged(chunks, name: str | None = None):
    """Within the block the adapted linears compute with adapter `name` (default: the only one) merged into their
    weights, adapters off: the weights --lora-sync merged sends the engines, computed as they compute them
    (--check-weight-update-equal's probe; the adapters' own path rounds differently: 1e-5 to 5e-5 in log-probs
    once the adapters have grown). The base weights are restored bit for bit after."""
    modules = _adapted_modules(chunks)
    saved = [m.weight.detach().clone() for m in modules]
    try:
        with torch.no_grad():
            for m in modules:
                m.weight.copy_(merged_weight(m, name))
                m.lora.enabled = False
        yield
    finally:
        with torch.no_grad():
            for m, weight in zip(modules, saved):
                m.weight.copy_(weight)
                m.lora.enabled = True


def attach_lora(chunk: torch.nn.Module, config: LoraSetup) -> None:
    """Freeze `chunk` (a GPTModel) and hang the adapters `config.names` on its targeted linears. The base modules
    keep their names and weights; the adapters are `<linear>.lora.<name>.*`."""
    for p in chunk.parameters():
        p.requires_grad_(False)
    _, tp_size = _tp()
    skipped: dict[str, set[int]] = {}  # layers without some targeted linear, by what they have instead
    adapted = 0
    for layer in chunk.decoder.layers:
        global_layer = layer.layer_number - 1
        for path, projections in _FUSED.items():
            wanted = tuple(p for p in projections if p in config.targets)
            if not wanted:
                continue
            try:
                module = layer.get_submodule(path)
            except AttributeError:  # an MoE layer's experts, or multi-latent attention: no adapters there yet
                kind = "MoE experts" if path.startswith("mlp") else "multi-latent attention"
                skipped.setdefault(kind, set()).add(global_layer)
                continue
            adapted += 1
            if hasattr(module, "layer_norm_weight"):
                raise ValueError("LoRA on TransformerEngine's norm-fused linears is not supported yet; run without "
                                 "TransformerEngine (the local layer spec) or without --lora-rank")
            weight = module.weight
            out_local, in_local = weight.shape
            row_parallel = path in _ROW_PARALLEL
            rows, groups = _rows(chunk.config, path, out_local, tp_size)
            module.lora = LoraSet({
                name: LoraAdapters(config, projections, in_local, rows, row_parallel, groups,
                                   tuple(_seed(config.seed, global_layer, p, name) for p in projections),
                                   weight.dtype, weight.device) for name in config.names})
            module.register_forward_hook(_add_adapters_hook)
            module.sharded_state_dict = _sharded_state_dict_with_adapters(module)
    where = "; ".join(f"{kind} of layer{'s' if len(layers) > 1 else ''} {_spans(sorted(layers))}"
                      for kind, layers in skipped.items())
    if not adapted:
        raise ValueError(f"--lora-target-modules {' '.join(config.targets)}: no targeted linear in this model part "
                         f"(LoRA adapts dense attention and MLP linears; not yet {where}): target attention "
                         "(q_proj k_proj v_proj o_proj) or train without --lora-rank")
    if skipped:
        logger.warning("LoRA adapts no %s (not supported yet): those layers keep their base weights there", where)


def _spans(layers: list[int]) -> str:
    """"1-3, 5" for [1, 2, 3, 5]."""
    spans, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def _sharded_state_dict_with_adapters(module):
    """Megatron's own `sharded_state_dict` of the linear (the same call), with the adapters' split axes: its
    default would save a tensor-parallel slice of B (column-parallel) or A (row-parallel) as if replicated."""
    row_parallel = module.lora.row_parallel
    axes = {"weight": 1} if row_parallel else {"weight": 0, "bias": 0}
    for name, adapters in module.lora.items():
        axes.update({f"lora.{name}.A.{n}": 1 for n in adapters.A} if row_parallel else
                    {f"lora.{name}.B.{n}": 0 for n in adapters.B})

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=module.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    return sharded_state_dict


def _rows(config, path: str, out_local: int, tp_size: int) -> tuple[tuple[int, ...], int | None]:
    """Output rows of each fused projection on this rank (row-parallel: of the whole output), and the local
    KV-group count for linear_qkv."""
    if path == "self_attention.linear_qkv":
        groups = config.num_query_groups // tp_size
        head_dim = config.kv_channels
        q_rows = groups * (config.num_attention_heads // config.num_query_groups) * head_dim
        return (q_rows, groups * head_dim, groups * head_dim), groups
    if path == "mlp.linear_fc1":
        return (out_local // 2, out_local // 2), None
    return (out_local,), None


def adapted_linears(model: torch.nn.Module):
    """(global layer index, HF module: "self_attn" or "mlp", Megatron linear) of each linear with adapters."""
    for layer in model.decoder.layers:
        for path in _FUSED:
            try:
                module = layer.get_submodule(path)
            except AttributeError:  # an MLA or MoE layer: no such linear, no adapters
                continue
            if isinstance(getattr(module, "lora", None), LoraSet):
                yield layer.layer_number - 1, "self_attn" if path.startswith("self_attention") else "mlp", module


def load_peft_adapter(chunk: torch.nn.Module, path: str, name: str = DEFAULT_ADAPTER) -> None:
    """Set the chunk's adapter `name` from a PEFT adapter directory (this rank's slices of each matrix);
    --lora-load."""
    from safetensors import safe_open

    tp_rank, tp_size = _tp()
    with safe_open(f"{path}/adapter_model.safetensors", framework="pt") as f:
        stored = set(f.keys())
        for layer, hf_module, linear in adapted_linears(chunk):
            adapters = linear.lora[name]
            for proj in adapters.A:
                prefix = f"base_model.model.model.layers.{layer}.{hf_module}.{proj}"
                for kind, param in (("A", adapters.A[proj]), ("B", adapters.B[proj])):
                    tensor = f"{prefix}.lora_{kind}.weight"
                    if tensor not in stored:
                        raise ValueError(f"--lora-load {path}: the adapter has no {tensor}")
                    full = f.get_tensor(tensor)
                    split_dim = 1 if kind == "A" and adapters.row_parallel else \
                        0 if kind == "B" and not adapters.row_parallel else None
                    local = full if split_dim is None else full.chunk(tp_size, dim=split_dim)[tp_rank]
                    if local.shape != param.shape:
                        raise ValueError(f"--lora-load {path}: {tensor} has shape {tuple(full.shape)}, this model's "
                                         f"adapter needs {tuple(param.shape)} (on this rank)")
                    with torch.no_grad():
                        param.copy_(local)


def peft_config(config: LoraSetup, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": config.rank,
            "lora_alpha": config.alpha, "lora_dropout": config.dropout, "target_modules": list(config.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None}


def is_lora_parameter(name: str) -> bool:
    return ".lora." in name


def merged_weight(module: torch.nn.Module, name: str | None = None) -> torch.Tensor:
    """The module's weight with adapter `name` merged in (this rank's shard). `name` None: the only adapter; a
    multi-LoRA model's base weight when it has several (no one adapter is the policy: each is saved beside it)."""
    if name is None:
        if len(module.lora) > 1:
            return module.weight.detach()
        name = next(iter(module.lora))
    return module.weight.detach() + module.lora[name].delta_weight().to(module.weight.dtype)
