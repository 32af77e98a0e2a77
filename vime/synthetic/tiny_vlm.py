"""Build a tiny Qwen2.5-VL or Qwen3-VL checkpoint with its processor (image processor, tokenizer with the vision
tokens, a chat template that renders image parts). No downloads.

    python -m vime.synthetic.tiny_model --arch qwen2_5_vl --out /tmp/tiny-qwen2_5_vl

A normal HF checkpoint directory, as the published ones are laid out (config.json with `text_config` and
`vision_config`, model.safetensors, processor_config.json, the tokenizer files), that transformers'
AutoProcessor / AutoModelForImageTextToText and vLLM read. Images are resized to 64x64 .. 96x96 pixels' worth of
patches, so that a prompt with an image stays a few dozen tokens. Deterministic from `seed`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vime.synthetic.tiny_tokenizer import build_tokenizer

VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# ChatML, where a message's content may be a list of parts: an image part is the vision tokens around one image
# placeholder (which the processor widens to the image's patch count), a text part its text; as Qwen's templates.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
MIN_PIXELS, MAX_PIXELS = 64 * 64, 96 * 96  # ~4 .. ~16 merged patches (image tokens) per image


def _vision_config(arch: str, hidden_size: int) -> dict:
    """The vision tower: 2 blocks, 64 wide (2 heads of 32), patches merged 2 x 2 into one token of the language
    model's width; Qwen3-VL's with learned position embeddings on a 16 x 16 grid and one deepstack layer."""
    common = {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "out_hidden_size": hidden_size, "in_channels": 3}
    if arch == "qwen2_5_vl":
        return {**common, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1], "hidden_act": "silu"}
    return {**common, "patch_size": 16, "num_position_embeddings": 256, "deepstack_visual_indexes": [0],
            "hidden_act": "gelu_pytorch_tanh"}


def build_config(arch: str, tokenizer, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, intermediate_size: int):
    """The HF config of a tiny `arch` model: the language model as the text families' tiny ones, M-RoPE over its
    head dimension split (temporal, height, width) as the published configs split theirs."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    head_dim = hidden_size // num_heads
    half = head_dim // 2
    sections = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16 -> [4, 6, 6], as 64 -> [16, 24, 24]
    text = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "intermediate_size": intermediate_size, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections}
        return Qwen2_5_VLConfig(text_config=text, vision_config=_vision_config(arch, hidden_size),
                                tie_word_embeddings=False, **ids)
    text.update(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                    "mrope_section": sections, "mrope_interleaved": True})
    return Qwen3VLConfig(text_config=text, vision_config=_vision_config(arch, hidden_size),
                         tie_word_embeddings=False, **ids)


def build_processor(arch: str, out: Path, tokenizer):
    """The model's processor (image processor + tokenizer + chat template), saved to `out`."""
    from transformers import (Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLProcessor,
                              Qwen3VLVideoProcessor)

    patch = 14 if arch == "qwen2_5_vl" else 16
    image = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                  min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    video_class = Qwen2VLVideoProcessor if arch == "qwen2_5_vl" else Qwen3VLVideoProcessor
    video = video_class(patch_size=patch, merge_size=2, temporal_patch_size=2,
                        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor_class = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen3VLProcessor
    processor = processor_class(image_processor=image, video_processor=video, tokenizer=tokenizer,
                                chat_template=VLM_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return processor


def build_tiny_vlm(out: str | os.PathLike, arch: str = "qwen2_5_vl", seed: int = 0, vocab_size: int = 512,
                   hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   intermediate_size: int = 256) -> Path:
    """Write a randomly initialised (seeded) `arch` checkpoint with its processor to `out`; returns the path."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if arch not in VLM_ARCHS:
        raise ValueError(f"{arch!r} is not a vision-language family vime builds ({', '.join(VLM_ARCHS)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size, seed, extra_special=VISION_TOKENS, chat_template=VLM_CHAT_TEMPLATE)
    config = build_config(arch, tokenizer, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                          intermediate_size)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF init leaves norms and biases at constants; perturb all, as the text families do
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    build_processor(arch, out, tokenizer)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    (out / "vime_tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed, "config": {}}))
    return out
