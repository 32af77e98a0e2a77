"""Every blocking call from the driver to an actor has a deadline and a name.

A Ray call that never returns (a custom function awaiting forever, a collective with a missing member, a stuck
engine) would otherwise hang the run without a word. `gather` waits for a group's answers, raises the first failure
as soon as it happens (the other members of a collective would otherwise sit in it until their own timeout), and
after `timeout` seconds raises `DeadlineExceeded` naming what it waited for and the flag that sets the deadline.

Deadlines: --train-timeout for the trainers' work (building models, a rollout's steps, a save, a weight update),
--rollout-timeout for a rollout or eval (`vime.driver.session`), CONTROL_TIMEOUT for the calls that only read or
flip state (addresses, engine URLs, the data source's position, sleep and wake-up).
"""

from __future__ import annotations

import time

import ray

CONTROL_TIMEOUT = 600.0  # seconds: calls that answer at once unless something is wrong


class DeadlineExceeded(TimeoutError):
    pass


def gather(refs, what: str, timeout: float | None, flag: str | None = None):
    """ray.get of one ref or a list of refs, at most `timeout` seconds (None: no deadline); a failure of any
    ref raises at once. `what` names the call in the error ("the trainers' save of rollout 3")."""
    single = not isinstance(refs, (list, tuple))
    order = [refs] if single else list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(order)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready and time.monotonic() < deadline:
            continue  # ray.wait rounds its timeout to milliseconds and may return a hair early
        if not ready:
            hint = f"; raise {flag} if it is only slow" if flag else ""
            raise DeadlineExceeded(f"{what} did not finish within {timeout:g}s ({len(pending)} of {len(order)} "
                                   f"answers missing): a process is stuck or waits on one that is{hint}")
        ray.get(ready)  # raises the failure of a member that failed
    results = ray.get(order)
    return results[0] if single else results


def control(ref, what: str):
    """A call that only reads or flips state: CONTROL_TIMEOUT."""
    return gather(ref, what, CONTROL_TIMEOUT)
