"""`--rm-type exact_match`: 1.0 iff the stripped response equals the stripped label (case-sensitive)."""

from __future__ import annotations

from .registry import register_rm


@register_rm("exact_match")
def exact_match_rm(args, sample) -> float:
    return float(sample.response.strip() == str(sample.label).strip())
