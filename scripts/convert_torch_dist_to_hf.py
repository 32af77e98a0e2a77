"""Convert a Megatron torch_dist checkpoint back to an HF checkpoint (safetensors + config + tokenizer).

    python scripts/convert_torch_dist_to_hf.py --load /tmp/ckpt --hf-checkpoint /tmp/tiny-qwen3 --save /tmp/hf-out

--load is a checkpoint root with latest_checkpointed_iteration.txt ("release" -> LOAD/release, N ->
LOAD/iter_000000N), or a torch_dist directory itself. The model's sharded state dict is read from the key
"model", whatever TP/PP layout wrote it. --hf-checkpoint supplies the architecture (config.json) and the
config/tokenizer files copied next to the weights. Runs in one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron.core import dist_checkpointing
from transformers import AutoConfig

from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
from vime.trainer.megatron.checkpoint import no_code_from_files
from vime.trainer.megatron.hf_checkpoint import save_hf_checkpoint
from vime.trainer.megatron.model_provider import build_model_chunks
from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(load: str) -> Path:
    """The torch_dist directory that --load points to (through the tracker file when there is one)."""
    root = Path(load)
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        return root
    latest = tracker.read_text().strip()
    return root / ("release" if latest == "release" else f"iter_{int(latest):07d}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="torch_dist checkpoint root or directory (required).")
    parser.add_argument("--hf-checkpoint", required=True,
                        help="HF checkpoint giving config.json and the tokenizer files to copy (required).")
    parser.add_argument("--save", required=True, help="Output HF checkpoint directory (required).")
    args = parser.parse_args(argv)
    ckpt = checkpoint_dir(args.load)
    if not (ckpt / "metadata.json").is_file():
        parser.error(f"--load {args.load}: {ckpt} is not a torch_dist checkpoint (no metadata.json)")

    init_parallel(1, 1)
    try:
        model_args = add_megatron_args(argparse.ArgumentParser()).parse_args([])
        model_args = fill_architecture_from_hf(model_args, AutoConfig.from_pretrained(args.hf_checkpoint))
        model = build_model_chunks(model_args)
        with no_code_from_files():  # a checkpoint from elsewhere: its pickles may hold only data
            state = dist_checkpointing.load({"model": model[0].sharded_state_dict()}, str(ckpt))
        model[0].load_state_dict(state["model"])
        save_hf_checkpoint(model, args.hf_checkpoint, args.save)
    finally:
        destroy_parallel()
    print(f"wrote {args.save}")


if __name__ == "__main__":
    main()
