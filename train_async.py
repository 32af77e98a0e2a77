"""vime's asynchronous RL loop: generation of rollout N+1 overlaps training on rollout N.

    python train_async.py --hf-checkpoint DIR --prompt-data data.jsonl --rm-type math ...

Engines and trainers sit on separate devices (disaggregated). Rollout N+1 is generated with the weights from
before training on rollout N, so samples are one update stale (more with --update-weights-interval > 1). With
--update-weights-in-flight the engines take each update as soon as it is trained, between decode steps of rollout
N+1, whose tokens then come from two versions. `--max-staleness K` (continuous mode) generates up to K rollouts
ahead, back to back, pushes every update in flight, and leaves out of the loss any sample with a token more than K
versions older than the weights it would train. Every token records the version that sampled it
(`weight_version_spans`), and the staleness is reported per rollout, per sample and per token.
"""

from __future__ import annotations

import time
from collections import deque

from vime.config.run import PlacementConfig
from vime.data.weight_versions import staleness_metrics
from vime.driver.entry_point import engine_idle_fraction, exit_after_run, run_entry_point
from vime.driver.session import TrainingSession
from vime.utils.logging_utils import progress


def train(args) -> None:
    if PlacementConfig.of(args).colocate:
        raise ValueError("train_async.py overlaps generation and training, so they need separate devices: "
                         "drop --colocate or use train.py")
    with TrainingSession(args, overlap=True) as run:
        loop, evaluation = run.config.train, run.config.eval
        start, num_rollout = run.start()
        run.maybe_eval(start)
        # rollouts generated ahead of training: one, or --max-staleness K back to back (the manager runs them in
        # order, so the engines never wait for the trainer)
        ahead = loop.max_staleness or 1
        in_flight = bool(loop.update_weights_in_flight or loop.max_staleness)
        pending = deque(run.generate(i) for i in range(start, min(start + ahead, num_rollout)))
        for rollout_id in progress(range(start, num_rollout), desc="rollouts", initial=start, total=num_rollout):
            step_start = time.perf_counter()
            rollout, metrics = run.collect(pending.popleft())
            waited = time.perf_counter() - step_start  # the trainer had nothing to train
            if rollout_id + ahead < num_rollout:
                pending.append(run.generate(rollout_id + ahead))  # runs on the engines while we train below
            metrics.update(staleness_metrics(rollout.extra.get("version_tokens", []), run.weight_version))
            metrics.update(run.train(rollout))
            run.maybe_save(rollout_id, num_rollout)
            if (rollout_id + 1) % loop.update_weights_interval == 0 or rollout_id + 1 == num_rollout:
                # the trainers write the new weights while rollout N+1 generates; the engines load them once it is
                # done, or in flight (--update-weights-in-flight, --max-staleness), between its decode steps
                now = in_flight and bool(pending)
                after = [pending[0]] if pending and not now else None
                metrics.update(run.update_weights(version=rollout_id + 1, after=after, in_flight=now))
                metrics["async/in_flight_updates"] = float(now)
                if evaluation.eval_interval and (rollout_id + 1) % evaluation.eval_interval == 0:
                    run.maybe_eval(rollout_id + 1, force=True)
            metrics["perf/step_time"] = time.perf_counter() - step_start
            metrics["perf/trainer_idle_fraction"] = waited / metrics["perf/step_time"]
            metrics["perf/engine_idle_fraction"] = engine_idle_fraction(metrics, metrics["perf/step_time"])
            run.metrics.log(rollout_id, metrics)
            run.publish_checkpoint()  # after the metrics line: a resume never skips a row


def main(argv: list[str] | None = None) -> None:
    run_entry_point(train, argv)


if __name__ == "__main__":
    main()
    exit_after_run()
