"""SFT warm-up data for the reasoning-gym example: reasoning-gym entries with the answer in the format its scorer
reads (`<answer>...</answer>`), drawn with another seed than the RL run's entries.

    python examples/reasoning_gym/make_data.py --out DIR --dataset chain_sum --config '{"min_terms": 2}' --n 512

Writes DIR/sft.jsonl, rows {"prompt", "label", "metadata": {"response"}} (vime.rollout.sft_rollout reads the
response from the metadata).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import reasoning_gym


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--config", default="{}", help="JSON config of the dataset (its config dataclass' fields).")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--seed", type=int, default=10_000)
    a = p.parse_args()
    data = reasoning_gym.create_dataset(a.dataset, size=a.n, seed=a.seed, **json.loads(a.config))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sft.jsonl").open("w") as f:
        for entry in data:
            f.write(json.dumps({"prompt": entry["question"], "label": entry["answer"],
                                "metadata": {"response": f"<answer>{entry['answer']}</answer>"}}) + "\n")
    print(f"{a.n} rows -> {out / 'sft.jsonl'}")


if __name__ == "__main__":
    main()
