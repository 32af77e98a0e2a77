"""The two report channels of a LocalSandbox run: the jail's pipe decides the exit code, the program's own event
log can only name a cause; nothing either holds makes parsing raise, and nothing the program writes reads as
success."""

from __future__ import annotations

import os
import signal

from vime.agents.sandbox.events import parse_jail_events, parse_program_events
from vime.agents.sandbox.verdict import run_result


def _wait_status(code: int | None = None, sig: int | None = None) -> int:
    return sig if sig is not None else code << 8


def _run_result(jail: bytes, hints: str, returncode: int = 0, timed_out: bool = False):
    return run_result(b"", b"", False, False, returncode, timed_out, False, False, parse_jail_events(jail),
                      parse_program_events(hints), 0.1)


def test_the_jail_status_decides_the_exit_code():
    exited_1 = b'{"event": "exit", "status": %d}\n' % _wait_status(1)
    forged = '{"event": "exit", "signal": 0}\n{"event": "exit", "status": 0}\n'
    r = _run_result(exited_1, forged, returncode=1)
    assert r.exit_code == 1 and not r.ok and r.stopped_reason == "tampering", r
    killed = b'{"event": "exit", "status": %d}\n' % _wait_status(sig=signal.SIGXCPU)
    r = _run_result(killed, "")
    assert r.exit_code == -signal.SIGXCPU and r.stopped_reason == "timeout"
    assert _run_result(b'{"event": "isolation"}\n{"event": "exit", "status": 0}\n', "").ok


def test_a_jail_that_never_reported_is_a_sandbox_error_not_a_success():
    r = _run_result(b"", "", returncode=0)
    assert not r.ok and r.stopped_reason == "sandbox_error" and "before reporting" in r.violations[0]["detail"]
    r = _run_result(b"", "", returncode=-9, timed_out=True)
    assert r.stopped_reason == "timeout" and r.exit_code == -9


def test_malformed_events_are_recorded_not_raised():
    garbage = ['[1]', '{"event": "violation"}', '{"event": "violation", "reason": "timeout"}',
               '{"event": "violation", "reason": "network", "detail": 5}', 'not json', '"x"', 'null',
               '{"event": "isolation_error", "message": "forged"}']
    violations = parse_program_events("\n".join(garbage))
    assert [v["reason"] for v in violations] == ["tampering"] * len(garbage)
    r = _run_result(b'{"event": "exit", "status": 0}\n', "\n".join(garbage))
    assert r.exit_code == 0 and r.stopped_reason == "tampering" and not r.ok  # and not a sandbox_error
    jail = parse_jail_events(b'{"event": "exit", "status": "0"}\n\xff\xfe\n[]\n')
    assert jail.exit_status is None and len(jail.problems) == 3


def test_a_deeply_nested_line_is_tampering_not_a_recursion_error():
    deep = "[" * 5000 + "]" * 5000  # json.loads gives up near 1,000 levels with RecursionError
    assert parse_program_events(deep) == [{"reason": "tampering", "detail": f"not a sandbox event: {deep[:200]}"}]
    assert parse_jail_events(deep.encode() + b'\n{"event": "exit", "status": 0}\n').exit_status == 0


def test_a_program_hint_names_the_cause():
    hint = '{"event": "violation", "reason": "forbidden_write", "detail": "/etc/x"}\n'
    r = _run_result(b'{"event": "exit", "status": %d}\n' % _wait_status(1), hint, returncode=1)
    assert r.stopped_reason == "forbidden_write" and r.exit_code == 1
    assert parse_program_events(hint * 100)[49:] == [{"reason": "forbidden_write", "detail": "/etc/x"}]


def test_exit_status_is_os_wait_status():
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    status = os.waitpid(pid, 0)[1]
    assert _run_result(b'{"event": "exit", "status": %d}\n' % status, "", returncode=3).exit_code == 3
