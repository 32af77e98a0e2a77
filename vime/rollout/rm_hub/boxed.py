"""`--rm-type boxed` and `deepscaler`: the last `\\boxed{}` answer, normalised, compared string-wise (1.0 / 0.0)."""

from __future__ import annotations

from .answer_utils import last_boxed, normalize_answer
from .registry import register_rm


def grade_boxed(response: str, label) -> float:
    """1.0 if the last `\\boxed{}` in `response` equals `label` after `normalize_answer`; a boxed label is unwrapped."""
    pred = last_boxed(response)
    if pred is None:
        return 0.0
    gold = str(label)
    gold = last_boxed(gold) or gold
    return float(normalize_answer(pred) == normalize_answer(gold))


@register_rm("boxed")
def boxed_rm(args, sample) -> float:
    return grade_boxed(sample.response, sample.label)


@register_rm("deepscaler")
def deepscaler_rm(args, sample) -> float:
    """As DeepScaleR: no `</think>` is a format error (0.0); only the text after it is graded."""
    _, sep, solution = sample.response.partition("</think>")
    if not sep:
        return 0.0
    return grade_boxed(solution, sample.label)
