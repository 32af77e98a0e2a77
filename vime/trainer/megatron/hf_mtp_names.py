"""HF names of the multi-token-prediction layers the trainer holds as `mtp.layers.{k}.` (`multi_token_prediction`,
Megatron-LM's names: enorm, hnorm, eh_proj, transformer_layer, final_layernorm):

- DeepSeek-V3 and GLM-4.5 store layer k after the decoder's N layers, as `model.layers.{N + k}.`: `enorm`,
  `hnorm`, `eh_proj`, `shared_head.norm` and a decoder layer shaped like the last;
- Qwen3-Next and Qwen3.5 store one layer under `mtp.`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`,
  `norm` and `layers.0.` (a full-attention decoder layer).
"""

from __future__ import annotations

import re
from typing import Callable

MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# Megatron suffix -> (kind, HF suffixes under model.layers.{N + k}., TP split dim), as hf_conversion's tables
MTP_PARAMS = {"enorm.weight": ("copy", ("enorm.weight",), None), "hnorm.weight": ("copy", ("hnorm.weight",), None),
              "eh_proj.weight": ("copy", ("eh_proj.weight",), 0),
              "final_layernorm.weight": ("copy", ("shared_head.norm.weight",), None)}
QWEN_MTP = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "eh_proj.weight": "mtp.fc.weight", "final_layernorm.weight": "mtp.norm.weight"}


def mtp_param(k: int, rest: str, arch, decoder_param: Callable[[int, str], tuple]) -> tuple:
    """(kind, HF names, split dim) of Megatron's `mtp.layers.{k}.{rest}`; `decoder_param(global layer, suffix)`
    maps a decoder layer's parameter (the MTP layer's transformer layer is one, numbered after the last)."""
    layer = arch.num_layers + k
    if rest in MTP_PARAMS:
        kind, hf_suffixes, split_dim = MTP_PARAMS[rest]
        names = (QWEN_MTP[rest],) if arch.mtp_under_mtp else tuple(f"{arch.prefix}layers.{layer}.{s}"
                                                                      for s in hf_suffixes)
        return kind, names, split_dim
    kind, names, split_dim = decoder_param(layer, rest.removeprefix("transformer_layer."))
    if arch.mtp_under_mtp:
        names = tuple(n.replace(f"{arch.prefix}layers.{layer}.", f"mtp.layers.{k}.", 1) for n in names)
    return kind, names, split_dim
