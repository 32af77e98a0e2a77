"""A pool of worker processes for calls that may hang or blow up: each call has a timeout, each worker a memory cap.

Who uses it: reward functions that can hang (`vime.rollout.rm_hub`). A thread that hangs cannot be stopped and
holds its pool's slot forever; a process can be killed. A call past its timeout kills its worker, which is replaced
(`on_replace` is called, e.g. to count it) and the caller gets `WorkerTimeoutError`.

Nothing crosses the process boundary as pickle: a call is one JSON line on a worker's stdin naming a function by
import path (`pkg.module.fn`) with JSON-able arguments, and the answer one JSON line on the worker's private stdout.
So the function must be importable in a fresh process (not defined in `__main__`, a notebook or a closure); workers
start with the `sys.path` the pool was made under. A coroutine function is run to completion with `asyncio.run`.

Each worker serves one call at a time; the pool's own threads (one per worker, not asyncio's default executor,
which synchronous agents use) wait on them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

MAX_ERROR_CHARS = 4000


class WorkerTimeoutError(TimeoutError):
    """A call ran past its timeout (or found no free worker before it); a running worker was killed and replaced."""


class WorkerDiedError(RuntimeError):
    """The worker exited during a call (a crash, its memory cap, a kill from outside); it was replaced."""


class WorkerCallError(RuntimeError):
    """The function raised in the worker (`error_type` names the exception class) or returned something not JSON."""

    def __init__(self, message: str, error_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy arrays and scalars (e.g. Sample.rollout_routed_experts)
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-able")


def to_json_line(value: Any) -> bytes:
    return (json.dumps(value, default=_jsonable, separators=(",", ":")) + "\n").encode()


def _ready(fd: int, event: int, timeout_s: float) -> bool:
    """Whether `fd` is ready for `event` (or hung up) within `timeout_s`. poll, not select: select refuses a
    descriptor numbered 1024 or above, which a long-lived process (a Ray actor, a test session) reaches."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(0, int(timeout_s * 1000) + 1)))


class _Worker:
    def __init__(self, cmd: list[str], env: dict[str, str]):
        # its own session, so that a kill also reaches processes the function started
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                                     start_new_session=True)
        os.set_blocking(self.proc.stdin.fileno(), False)  # a write must not outlive the call's deadline
        self.buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: bytes, deadline: float) -> bool:
        """Write `line`; False if the deadline passed first."""
        fd, view = self.proc.stdin.fileno(), memoryview(line)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if _ready(fd, select.POLLOUT, remaining):
                try:
                    view = view[os.write(fd, view):]
                except BrokenPipeError:
                    raise self._died() from None
        return True

    def receive(self, deadline: float) -> bytes | None:
        """The next reply line; None if the deadline passed first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if _ready(fd, select.POLLIN, remaining):
                data = os.read(fd, 1 << 16)
                if not data:
                    raise self._died()
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def _died(self) -> WorkerDiedError:
        return WorkerDiedError(f"worker process {self.pid} exited (code {self.proc.wait()}) during a call: it "
                               "crashed, hit its memory cap, or was killed")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class WorkerPool:
    """`size` worker processes, each capped at `memory_mb` of address space (None: no cap), that import `preload`
    modules when they start. Thread-safe; `call` blocks, `acall` awaits."""

    def __init__(self, size: int, memory_mb: int | None = None, preload: tuple[str, ...] = (),
                 on_replace: Callable[[], None] | None = None, name: str = "vime-worker"):
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got size={size}")
        self.size = size
        self.memory_mb = memory_mb
        self._cmd = [sys.executable, "-m", __name__, "--memory-mb", str(memory_mb or 0), *preload]
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self._on_replace = on_replace
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._closed = False
        self.replaced = 0
        self.started_pids: list[int] = []  # every worker this pool started, for checks that none outlived it
        self._threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix=name)
        for _ in range(size):
            self._idle.put(self._start())

    def _start(self) -> _Worker:
        worker = _Worker(self._cmd, self._env)
        with self._lock:
            self._live.add(worker)
            self.started_pids.append(worker.pid)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)
            if self._closed:
                return
            self.replaced += 1
        self._idle.put(self._start())
        if self._on_replace is not None:
            self._on_replace()

    def call(self, fn: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker, within `timeout` seconds (waiting for a free worker included)."""
        return self._run(fn, to_json_line({"fn": fn, "args": args, "kwargs": kwargs}), time.monotonic() + timeout,
                         timeout)

    async def acall(self, fn: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        """`call` without blocking the event loop. Cancelling it frees the caller at once; the worker is freed when
        the function returns or the timeout kills it."""
        line = to_json_line({"fn": fn, "args": args, "kwargs": kwargs})
        deadline = time.monotonic() + timeout
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._run, fn, line, deadline,
                                                                 timeout)

    def _run(self, fn: str, line: bytes, deadline: float, timeout: float) -> Any:
        if self._closed:
            raise RuntimeError(f"the worker pool is closed; cannot call {fn}")
        try:
            worker = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            worker = None
        if worker is None or time.monotonic() >= deadline:  # never kill a healthy worker for a call already late
            if worker is not None:
                self._idle.put(worker)
            raise WorkerTimeoutError(f"{fn} waited its whole {timeout:g}s timeout for a free worker (all {self.size} "
                                     "busy)")
        try:
            reply = worker.receive(deadline) if worker.send(line, deadline) else None
        except BaseException:
            self._replace(worker)
            raise
        if reply is None:
            self._replace(worker)
            raise WorkerTimeoutError(f"{fn} ran past its {timeout:g}s timeout; its worker process {worker.pid} was "
                                     "killed and replaced")
        self._idle.put(worker)
        answer = json.loads(reply)
        if answer["ok"]:
            return answer["result"]
        raise WorkerCallError(f"{fn} raised {answer['error_type']}: {answer['error']}", answer["error_type"],
                              answer.get("traceback", ""))

    def close(self) -> None:
        """Kill every worker; calls in flight fail with WorkerDiedError."""
        with self._lock:
            self._closed = True
            workers = list(self._live)
            self._live.clear()
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


# ---- what workers run ------------------------------------------------------------------------------------------

CALL_WITH_SAMPLE = f"{__name__}.call_with_sample"


def call_with_sample(fn_path: str, args: dict[str, Any], samples: dict | list[dict], kwargs: dict[str, Any]) -> Any:
    """`fn(args, sample(s), **kwargs)` for a function with slime's (args, sample) signature: rebuilds `args` as a
    Namespace and the `Sample`s from their `to_dict()`. Kept here, light, so that a worker starts fast."""
    import argparse

    from vime.utils.misc import load_function
    from vime.data.sample import Sample

    try:
        fn = load_function(fn_path)
    except (ImportError, AttributeError) as e:
        raise type(e)(f"{e}; each worker process imports {fn_path} afresh, so it must name a function in a module "
                      "on sys.path (not __main__ or a closure)") from None
    rebuilt = [Sample.from_dict(d) for d in samples] if isinstance(samples, list) else Sample.from_dict(samples)
    return fn(argparse.Namespace(**args), rebuilt, **kwargs)


# ---- the worker process ------------------------------------------------------------------------------------------

def _exit_with_parent(parent: int) -> None:
    """Exit once the parent is gone, even while a call hangs (stdin EOF alone would wait for the call)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _answer(request: dict[str, Any]) -> bytes:
    from vime.utils.misc import load_function

    fn_path = request["fn"]
    try:
        try:
            fn = load_function(fn_path)
        except (ImportError, AttributeError, ValueError) as e:
            raise type(e)(f"{e}; a function run in a worker process must be importable in a fresh process (from a "
                          "module on sys.path, not __main__ or a closure)") from None
        result = fn(*request["args"], **request["kwargs"])
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        try:
            return to_json_line({"ok": True, "result": result})
        except (TypeError, ValueError) as e:
            raise TypeError(f"its result {result!r:.200} cannot be sent back as JSON: {e}") from None
    except Exception as e:  # reported to the caller, which decides what a failure means
        return to_json_line({"ok": False, "error_type": type(e).__name__, "error": str(e)[:MAX_ERROR_CHARS],
                             "traceback": traceback.format_exc()[-MAX_ERROR_CHARS:]})


def serve(memory_mb: int, preload: list[str]) -> None:
    """The worker's loop: one JSON request per stdin line, one JSON reply per line on the original stdout."""
    import importlib
    import resource

    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a function's prints go to stderr, not into the replies
    sys.stdout = sys.stderr
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    _exit_with_parent(os.getppid())
    for module in preload:  # only to start warm: a module that fails here fails again, reported, in its call
        try:
            importlib.import_module(module)
        except Exception:
            traceback.print_exc()
    for line in sys.stdin.buffer:
        replies.write(_answer(json.loads(line)))


if __name__ == "__main__":
    serve(int(sys.argv[2]), sys.argv[3:])
