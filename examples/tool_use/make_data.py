"""Calculator tasks for the tool-use example: arithmetic a tiny model cannot do in its head.

    python examples/tool_use/make_data.py --out DIR [--train 512 --eval 64 --seed 0]

Each row: {"prompt", "label", "tools": [calculator schema], "metadata": {"conversation": [...]}}; the
conversation is a demonstration for the SFT warm-up: call the calculator, read its answer, box it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vime.agents.tools import CALCULATOR, format_number, safe_eval
from vime.synthetic.task_data import write_distinct_splits


def make_row(rng: random.Random) -> dict:
    a, b, c = rng.randint(11, 99), rng.randint(2, 19), rng.randint(1, 99)
    expression = rng.choice([f"{a} * {b} + {c}", f"{a} * {b} - {c}", f"({a} + {c}) * {b}"])
    answer = format_number(safe_eval(expression))
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return {
        "prompt": f"Use the calculator: what is {expression}?",
        "label": answer,
        "tools": [CALCULATOR.schema()],
        "metadata": {"conversation": [
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
        ]},
    }


def write_data(out: str | Path, n_train: int = 512, n_eval: int = 64, seed: int = 0) -> tuple[Path, Path]:
    train, evaluation = write_distinct_splits(out, make_row, {"train": n_train, "eval": n_eval}, seed)
    return train, evaluation


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(*write_data(a.out, a.train, a.eval, a.seed))
