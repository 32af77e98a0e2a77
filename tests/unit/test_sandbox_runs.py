"""Sandbox failures are never silent: each sandboxed run is recorded on its sample (the python tool's calls, a
grader's runs), counted per rollout (`rollout/sandbox/...`), a rollout with some failures of the sandbox itself
warns with the first error, and one where every sandboxed run failed that way stops the run before it reaches the
trainer (the rollout manager's own `generate`, around stand-ins for the fleet and the transport)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from vime.agents.sandbox import Sandbox, SandboxRefused, SandboxResult
from vime.agents.tool_parsing import ToolCall
from vime.agents.tools import TOOLS, ToolContext, run_tool_call
from vime.rollout.context import RolloutContext
from vime.rollout_manager.engine_health import FailedRollouts
from vime.rollout_manager.manager import RolloutManager
from vime.rollout.sandbox_runs import (SANDBOX_KEY, SandboxOutage, check_sandbox_runs, record_sandbox_run,
                                       sandbox_metrics)
from vime.data.sample import Sample

ISOLATION_ERROR = ("landlock: [Errno 13] /home/u/vime/.venv is out of reach of uid 1073741824: /home/u (mode 700, "
                   "uid 0) may not be searched by it")


def _failed_in_sandbox() -> SandboxResult:
    return SandboxResult(stdout="", stderr=f"sandbox: isolation failed, the program was not run: {ISOLATION_ERROR}\n",
                         exit_code=None, stopped_reason="sandbox_error",
                         violations=[{"reason": "sandbox_error", "detail": ISOLATION_ERROR}])


class ScriptedSandbox(Sandbox):
    """Answers each run with the next result (or raises it)."""

    def __init__(self, results):
        self.results = list(results)

    async def run(self, code=None, command=None, files=None, limits=None):
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def _call_python(sandbox, sample) -> str:
    ctx = ToolContext(sample=sample, sandbox=sandbox, timeout_s=5)
    call = ToolCall(name="python", arguments={"code": "print(1)"})
    return asyncio.run(run_tool_call(call, {"python": TOOLS["python"]}, ctx))


def test_sandbox_error_is_the_sandboxs_failure_only():
    assert _failed_in_sandbox().sandbox_error == ISOLATION_ERROR
    assert SandboxResult("", "Traceback ...", 1).sandbox_error is None  # the program's own failure
    assert SandboxResult("", "", -9, stopped_reason="timeout").sandbox_error is None
    jail_gone = SandboxResult("", "", None, stopped_reason="sandbox_error", violations=[])
    assert jail_gone.sandbox_error == "sandbox_error"


def test_the_python_tool_records_each_call_and_the_sandboxs_failures_on_its_sample():
    sample = Sample(index=0)
    ok = SandboxResult(stdout="1\n", stderr="", exit_code=0)
    crashed = SandboxResult(stdout="", stderr="ZeroDivisionError\n", exit_code=1)
    sandbox = ScriptedSandbox([ok, _failed_in_sandbox(), crashed, SandboxRefused("isolation too weak")])
    assert _call_python(sandbox, sample) == "1"
    assert "[stopped: sandbox_error]" in _call_python(sandbox, sample)
    assert "[exit code 1]" in _call_python(sandbox, sample)  # the model's own bug: not the sandbox's
    assert _call_python(sandbox, sample).startswith("Error: SandboxRefused")
    assert sample.metadata[SANDBOX_KEY] == {"tool": {"runs": 4, "errors": 2}, "first_error": ISOLATION_ERROR}
    _call_python(ScriptedSandbox([ok]), None)  # outside a rollout (no sample): nothing to record on


def _samples(records: list[list[tuple[str, str | None]]]) -> list[Sample]:
    samples = []
    for i, runs in enumerate(records):
        sample = Sample(index=i)
        for kind, error in runs:
            record_sandbox_run(sample, kind, error)
        samples.append(sample)
    return samples


def test_metrics_count_runs_and_errors_per_kind():
    samples = _samples([[("tool", None), ("tool", "jail died")], [("grading", None)], []])
    assert sandbox_metrics(samples, "rollout") == {
        "rollout/sandbox/grading_runs": 1.0, "rollout/sandbox/grading_errors": 0.0,
        "rollout/sandbox/tool_runs": 2.0, "rollout/sandbox/tool_errors": 1.0, "rollout/sandbox/error_ratio": 1 / 3}
    assert sandbox_metrics(_samples([[], []]), "eval/x") == {}  # no sandboxed run: no sandbox metrics


def test_some_failures_warn_with_the_first_error_and_all_of_them_stop(caplog):
    caplog.set_level(logging.WARNING, logger="vime.rollout.sandbox_runs")
    check_sandbox_runs(_samples([[("tool", None)], [("tool", None)]]), "rollout 0")
    assert not caplog.records
    check_sandbox_runs(_samples([[("tool", None)], [("tool", ISOLATION_ERROR)]]), "rollout 1")
    assert "rollout 1: 1 of 2 tool runs failed in the sandbox itself" in caplog.text and ISOLATION_ERROR in caplog.text
    with pytest.raises(SandboxOutage, match="rollout 2: every sandboxed run failed") as e:
        check_sandbox_runs(_samples([[("tool", ISOLATION_ERROR)], [("tool", "later"), ("grading", "x")]]),
                           "rollout 2")
    assert "1 of 1 grading runs, 2 of 2 tool runs" in str(e.value) and ISOLATION_ERROR in str(e.value)
    check_sandbox_runs(_samples([[], []]), "rollout 3")  # nothing ran in a sandbox: nothing to judge


class _Transport:
    def __init__(self):
        self.put_calls = []

    def put(self, rollout_id, dicts, extra):
        self.put_calls.append(rollout_id)
        return f"handle-{rollout_id}"


def _manager(groups):
    """The rollout manager's own `generate` and `_judge`, around stand-ins for what they call."""
    cls = RolloutManager.__ray_actor_class__
    args = SimpleNamespace()
    manager = SimpleNamespace(
        args=args, plugin_args=args, data_source=None, context=RolloutContext(),
        fleet=SimpleNamespace(recovery=SimpleNamespace(reconcile_router=lambda: None, check_soon=lambda: None),
                              spec_counters=lambda: None),
        rollout_fn=lambda _args, _rollout_id, _source: groups, failures=FailedRollouts(0.5, 3),
        transport=_Transport(), _keep_for_inspection=lambda name, dicts: None, data_source_state=lambda: None,
        hooks={"convert": None, "log_rollout": None, "log_eval": None})
    manager._judge = lambda rollout_id, metrics: cls._judge(manager, rollout_id, metrics)
    return manager, lambda rollout_id: cls.generate(manager, rollout_id)


def test_the_rollout_manager_stops_before_the_trainer_sees_a_rollout_whose_every_sandboxed_run_failed():
    failed = _samples([[("tool", ISOLATION_ERROR)], [("tool", ISOLATION_ERROR), ("grading", ISOLATION_ERROR)]])
    manager, generate = _manager([failed])
    with pytest.raises(SandboxOutage, match=r"rollout 0: every sandboxed run failed.*out of reach"):
        generate(0)
    assert manager.transport.put_calls == []  # never handed to training

    partly = _samples([[("tool", None)], [("tool", ISOLATION_ERROR)]])
    manager, generate = _manager([partly])
    ref = generate(4)
    assert manager.transport.put_calls == [4]
    assert ref.extra["metrics"]["rollout/sandbox/tool_runs"] == 2.0
    assert ref.extra["metrics"]["rollout/sandbox/tool_errors"] == 1.0
