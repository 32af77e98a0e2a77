"""String helpers shared by the answer-grading reward types."""

from __future__ import annotations

import re

_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_SIZING = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\[!,;:]")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, nested braces included.

    None when there is no `\\boxed{` or the last one is never closed (a truncated response).
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    open_brace = start + len("\\boxed")
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
    return None


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short LaTeX answer, for string-wise comparison.

    Unwraps `\\text{..}`-like commands, drops `\\left`/`\\right`, LaTeX spacing (`\\!`, `\\,`, ...), `$`,
    all whitespace and trailing periods, and spells `\\dfrac`/`\\tfrac` as `\\frac`.
    """
    s = _TEXT_COMMAND.sub(r"\1", str(answer))
    s = _SIZING.sub("", s)
    s = s.replace("$", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")
