"""Coding tasks for the coding-agent example: write `f(x)`, test it with the python tool, give the final code.

    python examples/coding_agent/make_data.py --out DIR [--train 512 --eval 64 --seed 0]

Each row: {"prompt", "label": hidden tests (asserts), "tools": [python schema], "metadata": {"conversation"}};
the conversation demonstrates the loop for the SFT warm-up: run the code, read the output, answer with the code.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vime.agents.tools import PYTHON
from vime.synthetic.task_data import write_distinct_splits

OPS = {"+": lambda x, k: x + k, "-": lambda x, k: x - k, "*": lambda x, k: x * k}


def make_row(rng: random.Random) -> dict:
    (op1, op2), a, b = rng.sample(list(OPS), 2), rng.randint(2, 9), rng.randint(1, 19)
    body = f"x {op1} {a} {op2} {b}" if op1 == "*" or op2 != "*" else f"(x {op1} {a}) {op2} {b}"
    code = f"def f(x):\n    return {body}"
    reference = eval("lambda x: " + body)  # our own template, never model output
    tests = "\n".join(f"assert f({x}) == {reference(x)}" for x in (0, 2, -3, 7))
    call = {"name": "python", "arguments": {"code": f"{code}\nprint(f(2))"}}
    return {
        "prompt": f"Write a Python function f(x) that returns {body}. Test it, then give the final code.",
        "label": tests,
        "tools": [PYTHON.schema()],
        "metadata": {"conversation": [
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": str(reference(2))},
            {"role": "assistant", "content": f"```python\n{code}\n```"},
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
