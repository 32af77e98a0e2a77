"""`--rm-type f1`: SQuAD token-level F1 between the response and the label, in [0, 1]."""

from __future__ import annotations

import re
import string
from collections import Counter

from .registry import register_rm

_PUNCTUATION = set(string.punctuation)


def squad_normalize(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    pred, ref = squad_normalize(prediction).split(), squad_normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@register_rm("f1")
def f1_rm(args, sample) -> float:
    return f1_score(sample.response, str(sample.label))
