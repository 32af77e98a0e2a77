"""`--rm-type random`: 0.0 or 1.0 uniformly, reproducible from `args.seed + sample.index` (a pipeline smoke test)."""

from __future__ import annotations

import random

from vime.config.run import JobConfig
from .registry import register_rm


@register_rm("random", needs_label=False)
def random_rm(args, sample) -> float:
    job = JobConfig.of(args)
    seed = (job.seed or 0) + (sample.index or 0)
    return float(random.Random(seed).randint(0, 1))
