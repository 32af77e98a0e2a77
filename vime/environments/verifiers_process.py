"""vime's side of the verifiers bridge (`verifiers_bridge.py`): the child process in verifiers' own venv, and its
JSON-lines protocol (one object a line; never pickle).

    bridge = BridgeProcess(python, "pkg.my_env", {"taskset": {...}}, log_dir, name="my_env")
    loaded = bridge.loaded(timeout_s=120)          # {"tasks": [...], "env_id": ..., "rewards": {...}}
    rid, future = bridge.request({"op": "episode", "task": 3, "session": token, "base_url": url})
    result = await asyncio.wrap_future(future)     # or bridge.cancel(rid) when vime gives up on it
    bridge.close()

The process starts at once (its load request on stdin); `loaded()` waits for the answer, so several
environments' bridges start side by side. Answers are read by a thread, so requests can come from any thread or
event loop. When the process exits, every pending request fails with its exit code and the tail of its log: a
dead bridge never leaves a rollout waiting.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from vime.utils.process import kill_tree, tail

BRIDGE = Path(__file__).resolve().with_name("verifiers_bridge.py")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
INSTALL_HINT = "bash scripts/install.sh creates it (.venv-verifiers), or point --verifiers-python at one"


class BridgeError(RuntimeError):
    """The bridge refused a request or is gone."""


def verifiers_python(path: str | None) -> Path:
    """The verifiers venv's Python (--verifiers-python, else the repository's .venv-verifiers), or a one-line
    error naming how to install it."""
    python = Path(path) if path else DEFAULT_PYTHON
    if not os.access(python, os.X_OK):
        raise ValueError(f"--environment verifiers:... runs verifiers 0.4.0 in its own venv (it cannot share vime's: "
                         f"it requires openai<3); there is no Python at {python}: {INSTALL_HINT}")
    return python


def bridge_environ(python: Path) -> dict[str, str]:
    """The bridge's environment: this one, with the verifiers venv first on PATH (its `uv` prepares the harness
    programs) and an import path of the run's working directory and PYTHONPATH only: vime's own site-packages
    (openai 3) must not shadow the verifiers venv's."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(python.parent), env.get("PATH", "")])
    paths = [os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(str(Path(p).resolve()) for p in paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class BridgeProcess:
    def __init__(self, python: Path, target: str, config: dict[str, Any], log_dir: Path, name: str,
                 take: int | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"verifiers_{name}.log"
        self.name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # _pending and stdin writes: requests come from the rollout's threads
        self._load: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[0] = self._load
        with open(self.log, "ab") as log:
            # own session, under vime's watchdog: the bridge and what verifiers starts go when this process goes
            self.proc = subprocess.Popen([sys.executable, "-m", "vime.utils.watchdog", str(os.getpid()), "--",
                                          str(python), str(BRIDGE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=bridge_environ(python), cwd=os.getcwd(),
                                         start_new_session=True)
        self._write({"id": 0, "op": "load", "target": target, "config": config, "take": take})
        threading.Thread(target=self._read, name=f"verifiers-bridge-{name}", daemon=True).start()

    def _write(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self._lock:
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the process is gone: the reader fails what is pending

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not protocol (the bridge keeps its stdout clean; tolerate a stray line anyway)
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = self.proc.wait()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        error = BridgeError(f"the verifiers bridge of environment {self.name} exited (code {code}); its log "
                            f"{self.log}:\n{tail(self.log, 2000)}")
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def loaded(self, timeout_s: float) -> dict[str, Any]:
        """The load answer (tasks, env id, reward weights); raises the bridge's error or after `timeout_s`."""
        try:
            reply = self._load.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise BridgeError(f"the verifiers bridge of environment {self.name} did not load within {timeout_s:g}s; "
                              f"its log {self.log}:\n{tail(self.log, 2000)}") from None
        if "error" in reply:
            raise ValueError(f"verifiers environment {self.name}: {reply['error']}")
        return reply

    def request(self, message: dict[str, Any]) -> tuple[int, concurrent.futures.Future]:
        """Send a request; its future gets the bridge's answer (a dict) or a BridgeError."""
        rid = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            alive = self.proc.poll() is None
            if alive:
                self._pending[rid] = future
        if not alive:
            future.set_exception(BridgeError(f"the verifiers bridge of environment {self.name} is not running "
                                             f"(code {self.proc.returncode}); its log {self.log}"))
            return rid, future
        self._write({**message, "id": rid})
        return rid, future

    def cancel(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)
        self._write({"op": "cancel", "id": rid})

    def close(self, grace_s: float = 15.0) -> None:
        """Ask the bridge to stop serving (verifiers stops its tool servers), then take its process group down."""
        self._write({"op": "close"})
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(self.proc, grace_s=5.0)
