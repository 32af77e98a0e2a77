"""Run a command and take its whole process group down when the owner dies.

    python -m vime.utils.watchdog OWNER_PID -- CMD ...

vLLM's server starts engine-core and worker processes of its own; PR_SET_PDEATHSIG on the server alone does not
reach them, and they can linger after a SIGKILLed owner. The watchdog leads a fresh process group holding the
command and everything it starts; once OWNER_PID is gone it SIGKILLs that group.

It watches from a forked grandchild: when an owner dies, Ray SIGKILLs the owner's direct children, which would
take a watcher down before it could act. The direct child only waits and passes the exit code on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(owner: int, cmd: list[str]) -> int:
    child = subprocess.Popen(cmd)  # same process group as the watchdog
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    while True:
        code = child.poll()
        if code is not None:
            return code
        if not _alive(owner):
            os.killpg(0, signal.SIGKILL)  # the command and all it started, the watchdog last
        time.sleep(0.5)


def main() -> None:
    owner = int(sys.argv[1])
    cmd = sys.argv[sys.argv.index("--") + 1:]
    pid = os.fork()
    if pid == 0:
        os._exit(watch(owner, cmd))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the command; wait for it
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
