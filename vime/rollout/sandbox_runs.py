"""The sandboxed runs behind a sample (the python tool's calls, a grader's run of its final code), recorded on the
sample, and what one rollout's records say: its metrics, a warning naming the first failure of the sandbox itself,
and an error that stops the run when every sandboxed run of a rollout failed that way.

    record_sandbox_run(sample, "tool", result.sandbox_error)    # the python tool; "grading" for a grader
    sandbox_metrics(samples, "rollout")                          # rollout/sandbox/tool_runs, .../tool_errors, ...
    check_sandbox_runs(samples, "rollout 3")                     # the rollout manager, before training on it

A `sandbox_error` (the program was never run, or its end was never observed) is the infrastructure's failure, not
the model's: the model reads "isolation failed" where its program's output should be, and its reward reflects the
sandbox rather than its code. A rollout in which every sandboxed run failed that way must not be trained on.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SANDBOX_KEY = "sandbox"  # sample.metadata[SANDBOX_KEY] = {kind: {"runs": n, "errors": k}, "first_error": "..."}
MAX_ERROR_CHARS = 500


class SandboxOutage(RuntimeError):
    """Every sandboxed run of a rollout failed in the sandbox itself."""


def record_sandbox_run(sample: Any, kind: str, error: str | None) -> None:
    """Count one sandboxed run of `kind` ("tool", "grading", ...) on `sample` (None: outside a rollout), and
    `error`, the sandbox's own failure (`SandboxResult.sandbox_error`), when there was one."""
    if sample is None:
        return
    record = sample.metadata.setdefault(SANDBOX_KEY, {})
    counts = record.setdefault(kind, {"runs": 0, "errors": 0})
    counts["runs"] += 1
    if error is not None:
        counts["errors"] += 1
        record.setdefault("first_error", str(error)[:MAX_ERROR_CHARS])


def _totals(samples: list) -> tuple[dict[str, list[int]], str | None]:
    """{kind: [runs, errors]} over the samples, and the first sandbox error among them."""
    totals: dict[str, list[int]] = {}
    first = None
    for sample in samples:
        record = sample.metadata.get(SANDBOX_KEY) or {}
        for kind, counts in record.items():
            if isinstance(counts, dict):
                total = totals.setdefault(kind, [0, 0])
                total[0] += int(counts.get("runs", 0))
                total[1] += int(counts.get("errors", 0))
        if first is None and record.get("first_error"):
            first = record["first_error"]
    return totals, first


def sandbox_metrics(samples: list, prefix: str) -> dict[str, float]:
    """`<prefix>/sandbox/<kind>_runs` and `<prefix>/sandbox/<kind>_errors` of every kind the samples ran, and
    `<prefix>/sandbox/error_ratio` over all of them; empty when nothing ran in a sandbox."""
    totals, _ = _totals(samples)
    metrics = {}
    for kind, (runs, errors) in sorted(totals.items()):
        metrics[f"{prefix}/sandbox/{kind}_runs"] = float(runs)
        metrics[f"{prefix}/sandbox/{kind}_errors"] = float(errors)
    runs = sum(r for r, _ in totals.values())
    if runs:
        metrics[f"{prefix}/sandbox/error_ratio"] = sum(e for _, e in totals.values()) / runs
    return metrics


def check_sandbox_runs(samples: list, where: str) -> None:
    """A warning naming the first sandbox error when some sandboxed runs of `where` failed in the sandbox itself;
    SandboxOutage when all of them did."""
    totals, first = _totals(samples)
    runs = sum(r for r, _ in totals.values())
    errors = sum(e for _, e in totals.values())
    if not errors:
        return
    counts = ", ".join(f"{e} of {r} {kind} runs" for kind, (r, e) in sorted(totals.items()) if e)
    if errors == runs:
        raise SandboxOutage(
            f"{where}: every sandboxed run failed in the sandbox itself ({counts}), so the model was scored on the "
            f"sandbox's failure, not its code; not training on it. The first error: {first}. Check the sandbox's "
            "isolation report in the log (LocalSandbox().isolation) and the paths it names")
    logger.warning("%s: %s failed in the sandbox itself (sandbox_error); the first error: %s", where, counts, first)
