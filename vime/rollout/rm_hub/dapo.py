"""`--rm-type dapo`: DAPO's "Answer: X" format, 1.0 if correct and -1.0 otherwise (a missing answer included)."""

from __future__ import annotations

import re

from .answer_utils import last_boxed, normalize_answer
from .registry import register_rm

_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


@register_rm("dapo")
def dapo_rm(args, sample) -> float:
    matches = _ANSWER_LINE.findall(sample.response)
    if not matches:
        return -1.0
    answer = matches[-1]
    answer = last_boxed(answer) or answer  # "Answer: \boxed{34}"
    gold = str(sample.label)
    return 1.0 if normalize_answer(answer) == normalize_answer(gold) else -1.0
