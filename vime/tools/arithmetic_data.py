"""A small arithmetic task with checkable answers, for the quickstart, tests and benchmarks.

    python -m vime.tools.arithmetic_data --out DIR [--train 512 --eval 64 --max-operand 20 --seed 0]

Writes DIR/train.jsonl and DIR/eval.jsonl with rows {"prompt": "...", "label": "..."}; train and eval
questions never overlap.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make_rows(n: int, rng: random.Random, max_operand: int, seen: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        answer = a + b if op == "+" else a - b
        rows.append({"prompt": f"What is {a} {op} {b}?", "label": str(answer)})
    return rows


def write_arithmetic_data(out: str | Path, n_train: int = 512, n_eval: int = 64, max_operand: int = 20,
                          seed: int = 0) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(seed), set()
    if n_train + n_eval > 2 * (max_operand + 1) ** 2:
        raise ValueError("not enough distinct questions: raise --max-operand")
    paths = []
    for name, n in (("train", n_train), ("eval", n_eval)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make_rows(n, rng, max_operand, seen)))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--train", type=int, default=512, help="Training questions (default: 512).")
    p.add_argument("--eval", type=int, default=64, help="Held-out questions (default: 64).")
    p.add_argument("--max-operand", type=int, default=20, help="Largest operand (default: 20).")
    p.add_argument("--seed", type=int, default=0, help="Seed (default: 0).")
    a = p.parse_args(argv)
    print(*write_arithmetic_data(a.out, a.train, a.eval, a.max_operand, a.seed))


if __name__ == "__main__":
    main()
