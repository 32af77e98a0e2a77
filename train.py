"""vime's synchronous RL loop: generate -> train -> save -> update weights -> eval.

    python train.py --hf-checkpoint DIR --prompt-data data.jsonl --rm-type math ...

`--debug-rollout-only` runs the rollout half alone (engines, router, rewards, saved rollouts);
`--debug-train-only --load-debug-rollout-data PATH` trains on saved rollouts without engines.
"""

from __future__ import annotations

import time

from vime.driver.entry_point import engine_idle_fraction, exit_after_run, run_entry_point
from vime.driver.session import TrainingSession
from vime.utils.logging_utils import progress


def train(args) -> None:
    with TrainingSession(args) as run:
        start, num_rollout = run.start()
        for rollout_id in progress(range(start, num_rollout), desc="rollouts", initial=start, total=num_rollout):
            step_start = time.perf_counter()
            run.maybe_eval(rollout_id)
            rollout, metrics = run.collect(run.generate(rollout_id))
            run.offload_rollout()  # colocated: the trainer gets the devices
            run.onload_train()
            metrics.update(run.train(rollout))
            run.maybe_save(rollout_id, num_rollout)
            run.onload_rollout(("weights",))  # what the update loads into; their KV cache still sleeps
            metrics.update(run.update_weights(version=rollout_id + 1))
            run.offload_train()  # colocated: the engines get the devices back,
            run.onload_rollout()  # and only then allocate their KV cache again
            metrics["perf/step_time"] = time.perf_counter() - step_start
            metrics["perf/engine_idle_fraction"] = engine_idle_fraction(metrics, metrics["perf/step_time"])
            run.metrics.log(rollout_id, metrics)
            run.publish_checkpoint()  # after the metrics line: a resume never skips a row
        run.maybe_eval(num_rollout, force=True)


def main(argv: list[str] | None = None) -> None:
    run_entry_point(train, argv)


if __name__ == "__main__":
    main()
    exit_after_run()
