"""`--rm-type math`: symbolic equivalence with the `math_verify` library (1.0 / 0.0).

sympy can hang (or eat memory) on adversarial answers, and a thread cannot be stopped, so the check runs in a
reward worker process (`pool.py`): past `--rm-timeout` the worker is killed and replaced and `math_rm` raises
TimeoutError. math_verify's own `signal.alarm` timeouts are off; the kill replaces them.
"""

from __future__ import annotations

from vime.rollout.worker_pool import WorkerTimeoutError

from .answer_utils import last_boxed
from .pool import reward_pool, reward_timeout
from .registry import register_rm

VERIFY_PATH = f"{__name__}.math_verify_reward"  # what the workers run


def math_verify_reward(response: str, label) -> float:
    """1.0 if the answer in `response` is mathematically equivalent to `label`, else 0.0.

    The answer is the last `\\boxed{}` when there is one, else the final expression math_verify finds.
    """
    from math_verify import parse, verify  # here, in the reward workers: the run's driver parses flags without it

    boxed = last_boxed(response)
    pred_text = f"\\boxed{{{boxed.strip().rstrip('.')}}}" if boxed is not None else response
    gold_text = str(label)
    # A bare label such as `2\sqrt{2}` is read as plain text (giving `2`) unless it sits in a LaTeX environment.
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = f"\\boxed{{{gold_text}}}"
    gold = parse(gold_text, parsing_timeout=None)
    pred = parse(pred_text, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@register_rm("math")
async def math_rm(args, sample) -> float:
    timeout = reward_timeout(args)
    try:
        return await reward_pool(args).acall(VERIFY_PATH, sample.response, sample.label, timeout=timeout)
    except WorkerTimeoutError as e:
        raise TimeoutError(f"sample {sample.index}: math_verify took over --rm-timeout {timeout:g}s ({e})") from None
