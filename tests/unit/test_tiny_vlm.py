"""Tiny vision-language checkpoints built here (`python -m vime.synthetic.tiny_model --arch qwen2_5_vl|qwen3_vl`):
transformers reads each back with its processor, which widens an image part of a chat into one placeholder token per
merged patch, and the model runs the image through its vision tower into the language model's logits."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vime.synthetic.tiny_model import main as tiny_model_main
from vime.synthetic.tiny_vlm import VLM_ARCHS, build_tiny_vlm


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_tiny_vlm_reads_back_and_sees_the_image(arch, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_vlm(tmp_path / arch, arch=arch, seed=1)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    red, blue = Image.new("RGB", (90, 60), (200, 30, 30)), Image.new("RGB", (90, 60), (30, 30, 200))
    batch = processor(text=[text, text], images=[red, blue], return_tensors="pt")
    merged = int(batch["image_grid_thw"][0].prod()) // 4  # 2 x 2 patches make one token
    assert 4 <= merged <= 16
    assert (batch["input_ids"] == model.config.image_token_id).sum(-1).tolist() == [merged, merged]
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == 512 and torch.isfinite(logits).all()
    # the image reaches the language model: the two colours give different next-token distributions
    assert (logits[0, -1] - logits[1, -1]).abs().max() > 1e-4
    again = build_tiny_vlm(tmp_path / "again", arch=arch, seed=1)
    first, second = load_file(path / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # the tensor names of the published checkpoints: Qwen2.5-VL's `visual.` and `model.layers.`, Qwen3-VL's
    # `model.visual.` and `model.language_model.layers.`
    visual, layers = ("visual.", "model.layers.") if arch == "qwen2_5_vl" else ("model.visual.",
                                                                                "model.language_model.layers.")
    assert any(k.startswith(visual + "blocks.1.") for k in first) and any(k.startswith(layers + "1.") for k in first)
    assert all(k.startswith((visual, layers, "lm_head.", "model.embed_tokens.", "model.norm.",
                             "model.language_model.embed_tokens.", "model.language_model.norm.")) for k in first)


def test_the_command_builds_a_vlm_and_refuses_text_only_options(tmp_path, capsys):
    tiny_model_main(["--arch", "qwen2_5_vl", "--out", str(tmp_path / "vl")])
    assert (tmp_path / "vl" / "config.json").exists() and (tmp_path / "vl" / "tokenizer.json").exists()
    with pytest.raises(SystemExit):
        tiny_model_main(["--arch", "qwen3_vl", "--out", str(tmp_path / "x"), "--with-mtp"])
    assert "--set, --tie-word-embeddings and --with-mtp are for the text families" in capsys.readouterr().err
