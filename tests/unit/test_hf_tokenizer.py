"""`load_tokenizer` gives what AutoTokenizer gives, without importing torch when the checkpoint names its class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from vime.utils.hf_tokenizer import load_tokenizer


def test_same_tokenizer_as_auto_without_torch(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    text = [{"role": "user", "content": "What is 12 + 30? <tool_call>"}]
    unnamed = tmp_path / "unnamed"  # no tokenizer_class, or custom code: AutoTokenizer decides
    shutil.copytree(tiny_qwen3, unnamed)
    config = json.loads((unnamed / "tokenizer_config.json").read_text())
    (unnamed / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                               if k != "tokenizer_class"}))
    for path in (tiny_qwen3, unnamed):
        auto, mine = AutoTokenizer.from_pretrained(path), load_tokenizer(str(path))
        assert type(mine) is type(auto)
        assert mine.apply_chat_template(text, tokenize=True, add_generation_prompt=True) == \
            auto.apply_chat_template(text, tokenize=True, add_generation_prompt=True)
        assert (mine.eos_token_id, mine.pad_token_id, len(mine)) == (auto.eos_token_id, auto.pad_token_id, len(auto))
    probe = ("import sys; from vime.utils.hf_tokenizer import load_tokenizer; "
             f"load_tokenizer({str(tiny_qwen3)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
