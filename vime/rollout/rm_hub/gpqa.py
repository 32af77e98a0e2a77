"""`--rm-type gpqa`: multiple choice; 1.0 iff the letter the response picks equals the label's letter.

Options are A-D, or as many letters as `sample.metadata["choices"]` has entries. The label may be a
letter ("C", "(C)"), a 0-based option index, or the text of one of the choices.
"""

from __future__ import annotations

import re
import string

from .answer_utils import last_boxed, normalize_answer
from .registry import register_rm


def extract_choice(text: str, letters: str) -> str | None:
    """The letter `text` picks, trying in order: the last `\\boxed{C}`, "Answer: C" / "the answer is (C)",
    "(C)", and finally the last standalone capital letter among `letters`. None if nothing matches."""
    boxed = last_boxed(text)
    if boxed is not None:
        candidate = normalize_answer(boxed).strip("()")
        if candidate in letters:
            return candidate
    cls = f"[{letters}]"
    patterns = (
        rf"(?i:answer)(?:\s+is)?[\s:*]*\(?({cls})\)?(?![A-Za-z])",
        rf"\(({cls})\)",
        rf"\b({cls})\b",
    )
    for pattern in patterns:
        matches = re.findall(pattern, text)
        if matches:
            return matches[-1]
    return None


def _gold_letter(sample, letters: str, choices) -> str:
    label = sample.label
    if isinstance(label, int) and 0 <= label < len(letters):
        return letters[label]
    if choices and label in choices:
        return letters[list(choices).index(label)]
    letter = extract_choice(str(label).strip(), letters)
    if letter is None:
        raise ValueError(f"sample {sample.index}: gpqa label {label!r} is not one of the options {letters}")
    return letter


@register_rm("gpqa")
def gpqa_rm(args, sample) -> float:
    choices = sample.metadata.get("choices")
    letters = string.ascii_uppercase[: len(choices) if choices else 4]
    return float(extract_choice(sample.response, letters) == _gold_letter(sample, letters, choices))
