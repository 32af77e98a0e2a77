"""Data for the async agent example: RL prompts ("Repeat the number N.") and an SFT warm-up set with both turns
of the agent loop (a first answer, sometimes wrong, then the follow-up and the correct final answer).

    python -m examples.async_agent.make_data --out DIR   # DIR/{train,eval,sft}.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vime.synthetic.arithmetic_data import write_arithmetic_data


def write_data(out: str | Path, n_train: int = 256, n_eval: int = 32, seed: int = 0) -> dict[str, Path]:
    from examples.async_agent.agent import FOLLOW_UP
    from examples.multi_agent.make_data import answer, corrupt

    out = Path(out)
    train, evaluation = write_arithmetic_data(out, n_train, n_eval, seed=seed, task="repeat")
    rng = random.Random(seed)
    rows = []
    for line in train.read_text().splitlines():
        row = json.loads(line)
        question, label = row["prompt"], row["label"]
        rows.append({"prompt": question, "label": label, "metadata": {"response": answer(label)}})
        first = label if rng.random() < 0.5 else corrupt(label, rng)
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": answer(first)},
                        {"role": "user", "content": FOLLOW_UP}]
        rows.append({"prompt": conversation, "label": label, "metadata": {"response": answer(label)}})
    sft = out / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": train, "eval": evaluation, "sft": sft}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write_data(a.out, a.train, seed=a.seed))
