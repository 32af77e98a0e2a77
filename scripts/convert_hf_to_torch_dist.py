"""Convert an HF checkpoint (Qwen2 / Qwen3 / Llama) to a Megatron torch_dist checkpoint.

    python scripts/convert_hf_to_torch_dist.py --hf-checkpoint /tmp/tiny-qwen3 --save /tmp/tiny-qwen3-torch-dist

Writes Megatron-LM's layout: SAVE/release/ (dist_checkpointing torch_dist; the model's sharded state dict
under the key "model") and SAVE/latest_checkpointed_iteration.txt containing "release". Runs in one process;
dist_checkpointing reshards on load, so any TP/PP layout can resume from it (`--load SAVE`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron.core import dist_checkpointing
from transformers import AutoConfig

from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
from vime.trainer.megatron.checkpoint import start_results_queue
from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
from vime.trainer.megatron.model_provider import build_model_chunks
from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", required=True, help="HF checkpoint directory to read (required).")
    parser.add_argument("--save", required=True, help="Directory to write the torch_dist checkpoint to (required).")
    args = parser.parse_args(argv)

    release_dir = Path(args.save) / "release"
    if release_dir.exists() and any(release_dir.iterdir()):
        parser.error(f"--save {args.save}: {release_dir} exists and is not empty")
    release_dir.mkdir(parents=True, exist_ok=True)

    init_parallel(1, 1)
    try:
        model_args = add_megatron_args(argparse.ArgumentParser()).parse_args([])
        model_args = fill_architecture_from_hf(model_args, AutoConfig.from_pretrained(args.hf_checkpoint))
        model = build_model_chunks(model_args)
        load_hf_checkpoint_into_model(model, args.hf_checkpoint)
        start_results_queue()
        dist_checkpointing.save({"model": model[0].sharded_state_dict()}, str(release_dir))
        (Path(args.save) / TRACKER_FILE).write_text("release")
    finally:
        destroy_parallel()
    print(f"wrote {release_dir}")


if __name__ == "__main__":
    main()
