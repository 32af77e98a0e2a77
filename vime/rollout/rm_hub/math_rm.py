"""`--rm-type math`: symbolic equivalence with the `math_verify` library (1.0 / 0.0).

math_verify guards `parse`/`verify` with `signal.alarm` timeouts, which raise ValueError off the main
thread. We turn those off and run the check in a worker thread, bounding the wait by `--rm-timeout`
instead: past it `math_rm` raises TimeoutError (the worker thread cannot be interrupted and finishes in the
background).
"""

from __future__ import annotations

import asyncio

from math_verify import parse, verify

from .answer_utils import last_boxed
from .registry import register_rm


def math_verify_reward(response: str, label) -> float:
    """1.0 if the answer in `response` is mathematically equivalent to `label`, else 0.0.

    The answer is the last `\\boxed{}` when there is one, else the final expression math_verify finds.
    """
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
    timeout = getattr(args, "rm_timeout", None)
    try:
        return await asyncio.wait_for(asyncio.to_thread(math_verify_reward, sample.response, sample.label), timeout)
    except TimeoutError:
        raise TimeoutError(f"sample {sample.index}: math_verify took over --rm-timeout {timeout}s") from None
