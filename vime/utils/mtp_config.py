"""How many multi-token-prediction (MTP) layers a checkpoint's language model declares, read as vLLM reads them:
DeepSeek-V3's, GLM-4.5's and Qwen3-Next's `num_nextn_predict_layers`, Qwen3.5's `mtp_num_hidden_layers`; Qwen's
configs may leave their one MTP layer unsaid, which vLLM's drafters then take as 1. The trainer
(`hf_architecture.multi_token_prediction_layers`) and the engines' flag checks (`engine.control.speculative`) both
ask here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Qwen's model types, of the language model and of its multimodal wrapper
QWEN_MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")


def declared_mtp_layers(values: Mapping[str, Any], model_type: str | None) -> int:
    """The MTP layers of a language model whose config values are `values` (config.json's, or a config object's
    attributes) and whose type is `model_type`."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if values.get(key) is not None:
            return int(values[key])
    return 1 if model_type in QWEN_MTP_MODEL_TYPES else 0
