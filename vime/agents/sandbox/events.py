"""What a LocalSandbox run reports, from two channels of different trust, parsed without raising.

- The jail's channel (a pipe only the jail holds, see jail.py): `isolation`, `isolation_error` and `exit` with the
  wait status the jail observed. Trusted: it alone decides the exit code and whether the program ran.
- The program's hints (the file $VIME_SANDBOX_EVENTS, written by the site hook inside the program): `violation`
  events that name why a program stopped (a refused write, the network, MemoryError...). The program can write this
  file, so a hint can only make its result worse: a known violation names the stop reason, anything else there
  (an `exit` event, an unknown reason, a line that is not such JSON) is recorded as `tampering`.

    jail = parse_jail_events(pipe_bytes)      # JailReport(exit_status=..., isolation_error=..., problems=[...])
    violations = parse_program_events(text)   # [{"reason": ..., "detail": ...}, ...]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# the causes the site hook names (sitecustomize.py); nothing else may come from the program
PROGRAM_REASONS = ("memory", "forbidden_write", "network", "process_limit", "file_size", "disk_quota")
MAX_EVENTS = 1000
MAX_VIOLATIONS = 50


@dataclass
class JailReport:
    exit_status: int | None = None  # the raw wait status of the program; None when the jail never said
    isolation_error: str | None = None  # why the program was not run
    problems: list[str] = field(default_factory=list)  # lines of the jail's channel that made no sense


def _json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: the program nested a line ~1,000 deep
        return None
    return value if isinstance(value, dict) else None


def parse_jail_events(data: bytes) -> JailReport:
    report = JailReport()
    for line in data.decode(errors="replace").splitlines()[:MAX_EVENTS]:
        event = _json_object(line)
        kind = event.get("event") if event else None
        if kind == "exit" and isinstance(event.get("status"), int) and not isinstance(event["status"], bool):
            report.exit_status = event["status"]
        elif kind == "isolation_error":
            report.isolation_error = str(event.get("message", ""))[:500]
        elif kind != "isolation":
            report.problems.append(line[:200])
    return report


def parse_program_events(text: str) -> list[dict[str, str]]:
    """The program's violations in order; whatever else it wrote is one `tampering` violation per line."""
    violations = []
    for line in text.splitlines()[:MAX_EVENTS]:
        if not line.strip():
            continue
        event = _json_object(line)
        if (event is not None and event.get("event") == "violation" and event.get("reason") in PROGRAM_REASONS
                and isinstance(event.get("detail", ""), str)):
            violations.append({"reason": event["reason"], "detail": event.get("detail", "")[:300]})
        else:
            violations.append({"reason": "tampering", "detail": f"not a sandbox event: {line[:200]}"})
        if len(violations) >= MAX_VIOLATIONS:
            break
    return violations
