"""Small tasks with checkable answers, for the quickstart, tests and benchmarks.

    python -m vime.synthetic.arithmetic_data --out DIR [--task add|repeat --train 512 --eval 64 --seed 0]

- add:    "What is 7 + 12?" -> 19 (operands up to --max-operand, + and -)
- repeat: "Repeat the number 4719." -> 4719 (3 to 5 digits); a tiny model learns it in minutes, so it is
          the quickstart's task.

Writes DIR/train.jsonl and DIR/eval.jsonl with rows {"prompt", "label", "metadata": {"response"}} (the
response is the reference answer in the format the reward checks, for an SFT warm-up); train and eval
questions never overlap.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def _row(prompt: str, answer) -> dict:
    return {"prompt": prompt, "label": str(answer),
            "metadata": {"response": f"The answer is \\boxed{{{answer}}}."}}


def make_repeat_rows(n: int, rng: random.Random, seen: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        number = rng.randint(100, 99999)
        if number not in seen:
            seen.add(number)
            rows.append(_row(f"Repeat the number {number}.", number))
    return rows


def make_rows(n: int, rng: random.Random, max_operand: int, seen: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        answer = a + b if op == "+" else a - b
        rows.append(_row(f"What is {a} {op} {b}?", answer))
    return rows


def write_arithmetic_data(out: str | Path, n_train: int = 512, n_eval: int = 64, max_operand: int = 20,
                          seed: int = 0, task: str = "add") -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(seed), set()
    if task == "add" and n_train + n_eval > 2 * (max_operand + 1) ** 2:
        raise ValueError("not enough distinct questions: raise --max-operand")
    if task not in ("add", "repeat"):
        raise ValueError(f"--task must be add or repeat, got {task!r}")
    paths = []
    for name, n in (("train", n_train), ("eval", n_eval)):
        rows = make_rows(n, rng, max_operand, seen) if task == "add" else make_repeat_rows(n, rng, seen)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--train", type=int, default=512, help="Training questions (default: 512).")
    p.add_argument("--eval", type=int, default=64, help="Held-out questions (default: 64).")
    p.add_argument("--max-operand", type=int, default=20, help="Largest operand (default: 20).")
    p.add_argument("--seed", type=int, default=0, help="Seed (default: 0).")
    p.add_argument("--task", choices=["add", "repeat"], default="add", help="Which task (default: add).")
    a = p.parse_args(argv)
    print(*write_arithmetic_data(a.out, a.train, a.eval, a.max_operand, a.seed, a.task))


if __name__ == "__main__":
    main()
