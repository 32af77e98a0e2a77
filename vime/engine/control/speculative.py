"""Speculative rollout: vLLM's own `--vllm-speculative-config` (a JSON), read and checked against the checkpoint
before any engine starts, and completed where a CPU engine needs it.

With `{"method": "mtp", "num_speculative_tokens": K}` the engines draft K tokens a step with the checkpoint's
multi-token-prediction layers; the trainer's MTP layers (`--mtp-num-layers`, trained with --enable-mtp-training)
reach the drafter with every weight update (`vime.engine.in_vllm.draft_loading`). The sampled distribution stays
the policy's: rejection sampling accepts a draft token with the policy's probability, and the returned log-probs
are the policy's (the train/rollout gap is logged every rollout, as without speculation).
"""

from __future__ import annotations

import json
import logging

from vime.config.train import MegatronConfig
from vime.utils.mtp_config import declared_mtp_layers

logger = logging.getLogger(__name__)


def speculative_config(args) -> dict | None:
    """The --vllm-speculative-config given, as a dict; None without one. Raises ValueError for a value that is not
    a JSON object."""
    raw = vars(args).get("vllm_speculative_config")
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"--vllm-speculative-config {raw!r} is not JSON ({e}); e.g. "
                         "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'") from e
    if not isinstance(value, dict):
        raise ValueError(f"--vllm-speculative-config {raw!r} must be a JSON object, e.g. "
                         "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'")
    return value


def drafts_with_mtp(config: dict | None) -> bool:
    """Whether the engines draft with the checkpoint's own MTP layers (vLLM's "mtp", or a family's legacy name
    such as "deepseek_mtp")."""
    method = str((config or {}).get("method") or "")
    return method == "mtp" or method.endswith("_mtp")


def mtp_layers_declared(hf_config: dict) -> int:
    """The MTP layers a checkpoint's config.json declares for its language model (`vime.utils.mtp_config`)."""
    text = hf_config.get("text_config") or hf_config
    return declared_mtp_layers(text, text.get("model_type") or hf_config.get("model_type"))


def check_speculative(args, hf_config: dict) -> None:
    """Refuse, before anything starts, an MTP speculative config the engines cannot run on this checkpoint: a model
    without MTP layers, or a draft length K that its layers cannot make (vLLM repeats n layers only when n
    divides K). Raises ValueError naming the flag."""
    config = speculative_config(args)
    if not drafts_with_mtp(config):
        return
    layers = mtp_layers_declared(hf_config)
    if layers and not MegatronConfig.of(args).mtp_num_layers:
        logger.warning("--vllm-speculative-config drafts with the checkpoint's MTP layers, which no weight update "
                       "will change (the trainer holds none): their drafts drift from the trained policy and fewer "
                       "are accepted; pass --mtp-num-layers %d so that updates carry them (and "
                       "--enable-mtp-training to train them)", layers)
    if not layers:
        raise ValueError(f"--vllm-speculative-config {json.dumps(config)}: {hf_config.get('model_type', 'the model')} "
                         "declares no MTP layers (num_nextn_predict_layers) to draft with; drop the option, or "
                         "name a draft model (\"method\": \"eagle\", \"model\": DIR)")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--vllm-speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if k > layers and k % layers:
        raise ValueError(f"--vllm-speculative-config: num_speculative_tokens {k} with {layers} MTP layers: vLLM "
                         f"drafts more tokens than layers only by repeating all of them, so K must be at most "
                         f"{layers} or a multiple of it")


def engine_speculative_tokens(args, user: list[str], mla_reference_attention: bool) -> list[str]:
    """`user` (the forwarded --vllm-* tokens) with the speculative config completed for this engine: a CPU engine
    of a multi-latent-attention model in float32 drafts with vLLM's reference MLA kernel too (its default AMX
    kernel refuses float32 weights when it loads the drafter), unless the config names a backend."""
    config = speculative_config(args)
    if config is None or not mla_reference_attention or "attention_backend" in config \
            or "--speculative-config" not in user:
        return user
    at = user.index("--speculative-config") + 1
    return [*user[:at], json.dumps({**config, "attention_backend": "CPU_MLA"}), *user[at + 1:]]
