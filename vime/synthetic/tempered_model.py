"""A checkpoint whose next-token distribution is another's at a temperature: logits / T exactly, by scaling the
final norm's weight by 1 / T (the output head is linear without bias, tied or not). A teacher for on-policy
distillation examples and tests that needs no training: T > 1 a warmer (flatter) teacher, T < 1 a sharper one.

    python -m vime.synthetic.tempered_model --src outputs/quickstart/sft_hf --out /tmp/teacher --temperature 2
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

FINAL_NORM = "model.norm.weight"  # Llama, Qwen, DeepSeek-V3 layouts


def temper_checkpoint(src: str | Path, out: str | Path, temperature: float) -> Path:
    from safetensors.torch import load_file, save_file

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    src, out = Path(src), Path(out)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{src}: no safetensors files")
    shutil.copytree(src, out, dirs_exist_ok=True)
    for shard in shards:
        weights = load_file(shard)
        if FINAL_NORM in weights:
            weights[FINAL_NORM] = weights[FINAL_NORM] / temperature
            save_file(weights, out / shard.name, metadata={"format": "pt"})
            return out
    raise KeyError(f"{src}: no {FINAL_NORM} in its safetensors files")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="HF checkpoint directory")
    parser.add_argument("--out", required=True, help="where the tempered copy is written")
    parser.add_argument("--temperature", type=float, required=True, help="logits are divided by it")
    args = parser.parse_args(argv)
    print(temper_checkpoint(args.src, args.out, args.temperature))


if __name__ == "__main__":
    main()
