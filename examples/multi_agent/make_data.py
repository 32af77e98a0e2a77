"""Data for the multi-agent example: RL prompts ("Repeat the number N.") and an SFT warm-up set that shows
both roles the answer format (the checker sees right and wrong proposals and always answers correctly).

    python -m examples.multi_agent.make_data --out DIR   # DIR/{train,eval,sft}.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vime.synthetic.arithmetic_data import write_arithmetic_data


def answer(n) -> str:
    return f"The answer is \\boxed{{{n}}}."


def corrupt(number: str, rng: random.Random) -> str:
    digits = list(number)
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
    return "".join(digits)


def write_data(out: str | Path, n_train: int = 256, n_eval: int = 32, seed: int = 0) -> dict[str, Path]:
    from examples.multi_agent.agent import checker_prompt

    out = Path(out)
    train, evaluation = write_arithmetic_data(out, n_train, n_eval, seed=seed, task="repeat")
    rng = random.Random(seed)
    rows = []
    for line in train.read_text().splitlines():
        row = json.loads(line)
        question, label = row["prompt"], row["label"]
        rows.append({"prompt": question, "label": label, "metadata": {"response": answer(label)}})
        proposed = label if rng.random() < 0.5 else corrupt(label, rng)
        rows.append({"prompt": checker_prompt(question, answer(proposed)), "label": label,
                     "metadata": {"response": answer(label)}})
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
