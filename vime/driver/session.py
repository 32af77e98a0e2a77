"""What train.py and train_async.py share: starting and stopping the pieces, resume, saving, eval, metrics.

The process around it (flags, Ray's shutdown, the exit) is `vime.driver.entry_point`'s."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from vime.arguments import ArgumentsError, build_parser, check_model_args, run_config
from vime.config import RunConfig
from vime.driver.placement import Placement, check_on_cluster_devices, init_ray, on_this_node
from vime.driver.previous_run import check_start
from vime.driver.train_group import RayTrainGroup, critic_args
from vime.driver.weight_sync import WeightSync
from vime.rollout_manager.engine_fleet import new_engines, run_control_token
from vime.rollout_manager.manager import RolloutManager, log_dir, resolve_num_rollout
from vime.trainer.megatron.train_arguments import lr_schedule_problem
from vime.transport.rollouts import RolloutRef, make_transport
from vime.transport.rollouts.replay import append_trained_samples, plan_replay, stored_rollout, truncate_trained_samples
from vime.transport.weights.check import check_weights_equal
from vime.utils.deadline import control, gather
from vime.utils.logging_utils import MetricsLogger
from vime.utils.misc import with_values
from vime.utils.plot import save_reward_curve
from vime.utils.resolved_config import plain_values, write_resolved_config
from vime.utils.run_lock import RunLock

logger = logging.getLogger(__name__)


class TrainingSession:
    """Engines + router (rollout manager), training actors and the metrics sinks of one run.

    Use as a context manager: everything it started is stopped on exit, also after an error or Ctrl-C.
    """

    def __init__(self, args, overlap: bool = False):
        self.args = args  # the slime-style view the actors are started with
        self.overlap = overlap  # training and generation run at the same time (train_async): they split the CPUs
        self.use_engines = not self.config.debug.debug_train_only
        self.train_enabled = not self.config.debug.debug_rollout_only
        self.manager = self.trainers = self.metrics = self.placement = None
        self.engines: list = []  # the engine actors made for the manager (`new_engines`)
        self.weight_version = 0
        self.transport = make_transport(self.config.data_buffer)  # stored rollouts: replayed after a crash, then let go
        self.replay: dict[int, RolloutRef] = {}  # rollout id -> a stored rollout to train instead of generating
        self.replayed: set[int] = set()
        self.data_state_after: dict[int, dict | None] = {}  # rollout id -> data-source state right after it
        self.trainer_restarts = 0
        self.total_steps = 0
        self.unpublished: int | None = None  # a saved checkpoint waiting for its rollout's metrics line
        self.manager_stuck = False  # a rollout outlived --rollout-timeout: the manager cannot take calls
        both = self.use_engines and self.train_enabled
        self.weight_sync = WeightSync.for_run(self.config, self.args) if both else None

    @functools.cached_property
    def config(self) -> RunConfig:
        """The run's typed flags (the same values as `args`)."""
        return run_config(self.args)

    def __enter__(self) -> TrainingSession:
        args, config = self.args, self.config
        # first: a second run on the same directories stops here, before it touches anything of the first's
        buffer = config.data_buffer
        stores = [config.job.output_dir, config.megatron.save,
                  buffer.rollout_data_dir if buffer.rollout_data_transport == "straw" else None]
        # before anything starts, and before the lock files name this run: refuse to take over an earlier run's state
        admit = (lambda: check_start(args, len(self.transport.stored()))) if self.train_enabled else None
        self.run_lock = RunLock(stores, admit=admit).__enter__()
        write_resolved_config(args, f"{config.job.output_dir}/config.yaml", build_parser())
        self._start_ray_checking_the_model()
        check_on_cluster_devices(args, self.train_enabled)  # what only the cluster's devices decide
        self.placement = Placement(config.placement, config.engines, config.judge,
                                   use_critic=config.algorithm.use_critic, with_engines=self.use_engines,
                                   with_trainers=self.train_enabled, overlap=self.overlap)
        if len(set(self.placement.bundle_nodes)) > 1:
            logger.info("placement over %d nodes: %s", len(set(self.placement.bundle_nodes)), self.placement.describe())
        token = run_control_token(args)
        # the engines' actors first: they boot beside the manager's, which takes them over
        self.engines = new_engines(args, self.placement, log_dir(args), token)  # none with --debug-train-only
        self.manager = RolloutManager.options(**on_this_node()).remote(args, self.placement, self.engines, token)
        self.critic = None
        if self.train_enabled:
            self._create_trainers()
        self.metrics = MetricsLogger(config.job.output_dir, config.wandb, plain_values(args))
        return self

    def _start_ray_checking_the_model(self) -> None:
        """Ray starts while the model is checked against its config (transformers' imports, ~3 s here); nothing of
        the run starts before the check passes."""
        with ThreadPoolExecutor(1, thread_name_prefix="model-check") as pool:
            checked = pool.submit(check_model_args, self.args)
            init_ray(self.config.job, self.config.placement, self.config.engines, self.config.judge)
            try:
                checked.result()
            except ValueError as e:
                raise ArgumentsError(str(e)) from e

    def _create_trainers(self, args=None) -> None:
        """Training actors (and PPO's critic) for `args` (default: the run's)."""
        args, placement = args or self.args, self.placement
        self.trainers = RayTrainGroup(args, placement)
        if self.config.algorithm.use_critic:
            self.critic = RayTrainGroup(critic_args(args), placement, role="critic")

    def _train_groups(self) -> list:
        """The training actor groups this run has: the actor's, and PPO's critic's."""
        return [g for g in (self.trainers, self.critic) if g is not None]

    def _init_trainers(self) -> dict | None:
        """Build the models (loading --load if it has a checkpoint) and hand them the run-time values of the
        manager's plugin view (its router's address is fixed before the router starts); returns the loaded
        checkpoint's state."""
        groups = self._train_groups()
        values = self.manager.plugin_values.remote()
        gather([ref for group in groups for ref in group.begin_init(total_steps=self.total_steps)],
               "building the trainers' models", self.config.job.train_timeout, "--train-timeout")
        values = control(values, "the rollout manager's plugin values")
        for group in groups:
            group.set_plugin_values(values)
        return self.trainers.get_loaded_state()[0]

    def start(self) -> tuple[int, int]:
        """Start engines and trainers, resume if --load has a checkpoint; returns (first rollout id, count).
        The trainers build their models while the engines boot, unless they share devices (--colocate), where
        the engines size their memory first."""
        args = self.args
        num_rollout = resolve_num_rollout(args, control(self.manager.num_prompts.remote(), "the prompt count"))
        steps = num_rollout * self.config.train.num_steps_per_rollout
        problem = lr_schedule_problem(args, steps) if self.train_enabled else None
        if problem:  # --num-epoch: the step count is known only now, still before any model is built
            raise ArgumentsError(problem)
        engines = self.manager.start.remote() if self.use_engines else None
        if engines is not None and self.placement.colocate:
            self._wait_for_engines(engines)
            if self.trainers is not None:
                self.offload_rollout()  # the trainers build their models in what the sleeping engines free
        resumed = None
        if self.trainers is not None:
            self.total_steps = steps
            resumed = self._init_trainers()
        if engines is not None:
            self._wait_for_engines(engines)
        start = 0
        if self.trainers is not None:
            if resumed:  # continue after the saved rollout, with the same data order
                start = resumed["rollout_id"] + 1
                control(self.manager.load_data_source_state.remote(resumed.get("data_source")),
                        "restoring the data source's position")
            self._plan_replay(start)
            self.onload_rollout(("weights",))  # the same order as every step of train.py
            self.update_weights(version=start)  # engines serve exactly the trainer's weights from now on
            self.offload_train()
            self.onload_rollout()
        if resumed or self.config.job.overwrite_output:  # rows of rollouts this run does again would be there twice
            self.metrics.drop_rows_from(start)
        return start, num_rollout

    def _wait_for_engines(self, engines) -> None:
        gather(engines, "starting the engines and the router", self.config.engines.engine_startup_timeout + 300,
               "--engine-startup-timeout")

    def update_weights(self, version: int, after: list | None = None, in_flight: bool = False) -> dict[str, float]:
        """Push the trainer's weights into the engines as `version`. `after`: rollouts still generating; the
        trainers write the weights meanwhile and the engines load them once those are done (train_async).
        `in_flight`: the engines load them now, between decode steps of the rollout in progress."""
        if not (self.use_engines and self.trainers is not None):
            return {}
        self.weight_version = version
        try:
            return self._update_weights(version, after, in_flight)
        except ray.exceptions.RayActorError as e:  # the trainers died after training: rebuild them, then push
            self._recover_trainers(trained_through=version - 1, error=e)
            metrics = self._update_weights(version, after, in_flight)
            metrics["recovery/trainer_restarts"] = float(self.trainer_restarts)
            return metrics

    def _update_weights(self, version: int, after: list | None = None, in_flight: bool = False) -> dict[str, float]:
        metrics = self.weight_sync.update(self.trainers, self.manager, version, after=after, in_flight=in_flight)
        if self.config.weight_sync.check_weight_update_equal:  # raises when an engine serves other weights
            metrics.update(check_weights_equal(self.args, self.trainers, self.manager))
        return metrics

    def _plan_replay(self, start: int) -> None:
        """With a durable transport, train rollouts stored by a crashed run instead of generating them again; the
        data source continues after the last of them."""
        self.replay = plan_replay(self.transport, start, self.config.job.output_dir,
                                  resuming=bool(self.config.megatron.load),
                                  data_dir=self.config.data_buffer.rollout_data_dir)
        if self.replay:
            control(self.manager.load_data_source_state.remote(self.replay[max(self.replay)].extra.get("data_source")),
                    "restoring the data source's position")

    def generate(self, rollout_id: int):
        """Start rollout `rollout_id` (replayed from storage when a crashed run stored it): an ObjectRef for
        `collect`."""
        if rollout_id in self.replay:
            self.replayed.add(rollout_id)
            return ray.put(self.replay.pop(rollout_id))
        return self.manager.generate.remote(rollout_id)

    def collect(self, pending) -> tuple[RolloutRef, dict[str, float]]:
        """Wait for a rollout from `generate`, at most --rollout-timeout: (its RolloutRef, its metrics); the samples
        stay in the transport for the training ranks."""
        rollout = self._wait_for_rollout(pending, "rollout")
        self.data_state_after[rollout.rollout_id] = rollout.extra.get("data_source")
        metrics = dict(rollout.extra.get("metrics") or {})
        metrics["buffer/replayed"] = float(rollout.rollout_id in self.replayed)
        return rollout, metrics

    def _wait_for_rollout(self, pending, what: str):
        """ray.get a rollout or eval call, at most --rollout-timeout; after that the manager is stuck in it (its
        actor runs one call at a time), so it is killed at exit instead of asked to shut down."""
        try:
            return ray.get(pending, timeout=self.config.rollout.rollout_timeout)
        except ray.exceptions.GetTimeoutError:
            self.manager_stuck = True
            rollout = self.config.rollout
            function = (what == "eval" and self.config.eval.eval_function_path) or rollout.rollout_function_path
            raise TimeoutError(f"the {what} did not finish within --rollout-timeout {rollout.rollout_timeout:g}s: "
                               f"the rollout function {function} (or a call it waits on) never returned. Fix the "
                               "function, or raise --rollout-timeout for longer rollouts") from None

    def offload_rollout(self) -> None:
        """Colocated runs: free the engines' device memory for training (--offload-rollout): their weights go to
        host memory, their KV cache is dropped (`EngineFleet.sleep`)."""
        if self.config.placement.offload_rollout and self.use_engines:
            control(self.manager.sleep.remote(), "the engines' sleep (--offload-rollout)")

    def onload_rollout(self, tags: tuple[str, ...] | None = None) -> None:
        """Wake the engines (--offload-rollout): only `tags` of their memory ("weights", "kv_cache"), or all that
        still sleeps (None). A weight update needs the weights alone, so `train.py` wakes them, updates, offloads
        the trainer and only then wakes the KV cache, which vLLM allocates anew: the trainer's state and the KV
        cache never hold the shared devices at once. With --check-weight-update-equal the engines generate right
        after the update (the probe), so they wake whole."""
        if not (self.config.placement.offload_rollout and self.use_engines):
            return
        if tags is not None and self.config.weight_sync.check_weight_update_equal:
            tags = None
        control(self.manager.wake_up.remote(list(tags) if tags is not None else None),
                "the engines' wake-up (--offload-rollout)")

    def offload_train(self) -> None:
        """Colocated runs: the trainer's state goes to host memory while the engines generate (--offload-train)."""
        for group in self._train_groups() if self.config.placement.offload_train else []:
            group.offload()

    def onload_train(self) -> None:
        for group in self._train_groups() if self.config.placement.offload_train else []:
            group.onload()

    def train(self, rollout: RolloutRef) -> dict[str, float]:
        """Train on one rollout. With straw and --save, training actors that die are restarted from the last
        checkpoint and the rollouts since it are replayed from storage; the engines keep running."""
        rollout_id = rollout.rollout_id
        skipped = self._skip_rollout(rollout)
        if skipped is not None:
            return skipped
        if self.trainers is None:  # --debug-rollout-only: nothing will ever replay it
            self.transport.trim([rollout_id])
            return {}
        start = time.perf_counter()
        try:
            metrics = self._train_step(rollout)
        except ray.exceptions.RayActorError as e:
            self._recover_trainers(trained_through=rollout_id - 1, error=e)
            metrics = self._train_step(rollout)
        if self.trainer_restarts:
            metrics["recovery/trainer_restarts"] = float(self.trainer_restarts)
        metrics["perf/train_time"] = time.perf_counter() - start
        append_trained_samples(self.config.job.output_dir, rollout_id, rollout.extra["sample_ids"],
                               replayed=rollout_id in self.replayed)
        if not self.config.megatron.save:  # nothing to resume from, so nothing to replay: let the rollout go now
            self.transport.trim([rollout_id])
            self.data_state_after.pop(rollout_id, None)
        return metrics

    def _skip_rollout(self, rollout: RolloutRef) -> dict[str, float] | None:
        """A rollout judged untrainable (`skip_reason`, `vime.rollout_manager.engine_health.FailedRollouts`) is not
        trained on and is let go from storage (nothing will replay it); returns its metrics row's entries, or None to
        train on it."""
        reason = rollout.extra.get("skip_reason")
        if reason is None:
            return None
        logger.error("not training on %s", reason)
        self.transport.trim([rollout.rollout_id])
        if not self.config.megatron.save:  # else a checkpoint at this rollout needs the data-source state after it
            self.data_state_after.pop(rollout.rollout_id, None)
        return {"train/skipped_rollout": 1.0}

    def _train_step(self, rollout: RolloutRef) -> dict[str, float]:
        if self.critic is None:
            return self.trainers.train(rollout.rollout_id, rollout.handle)
        # PPO: critic values -> actor (GAE, returns) -> critic regression; refs pass between actors, never fetched
        values = self.critic.compute_values(rollout.handle)
        metrics, returns = self.trainers.train_with_values(rollout.rollout_id, rollout.handle, values)
        metrics.update(self.critic.train_critic(rollout.rollout_id, rollout.handle, values, returns))
        return metrics

    def _recover_trainers(self, trained_through: int, error: Exception) -> None:
        """New training actors from the last checkpoint, retrained on the stored rollouts after it up to
        `trained_through`, so they hold what the dead ones did. Needs straw and --save; else the run stops with an
        error that says how to resume."""
        save = self.config.megatron.save
        if not (self.transport.durable and save):
            resume = (f"start the run again with --load {save} to resume from its last checkpoint" if save
                      else "it has no --save, so no checkpoint to resume from")
            raise RuntimeError(f"the training actors died ({type(error).__name__}: {error}). A run replaces them by "
                               "itself only with --rollout-data-transport straw and --save; this one stops: "
                               f"{resume}") from error
        logger.error("training actors died (%s); restarting them from %s", type(error).__name__, save)
        for group in self._train_groups():
            group.shutdown()
        self.critic = None
        self._create_trainers(with_values(self.args, load=self.config.megatron.save))  # its own last checkpoint
        self.weight_sync = WeightSync.for_run(self.config, self.args)  # new writers: a new collective group
        resumed = self._init_trainers()
        first = resumed["rollout_id"] + 1 if resumed else 0
        stored = self.transport.stored()
        missing = [i for i in range(first, trained_through + 1) if i not in stored]
        if missing:
            raise RuntimeError(f"cannot recover the trainer: rollouts {missing} after its checkpoint are not stored "
                               f"in {self.config.data_buffer.rollout_data_dir}") from error
        truncate_trained_samples(self.config.job.output_dir, first)  # what the crash undid is trained again below
        for i in range(first, trained_through + 1):
            replayed = stored_rollout(self.transport, stored[i])
            self._train_step(replayed)
            append_trained_samples(self.config.job.output_dir, i, replayed.extra["sample_ids"], replayed=True)
        self.trainer_restarts += 1
        logger.info("trainers restarted (%d so far); replayed rollouts %d..%d from storage", self.trainer_restarts,
                    first, trained_through)

    def maybe_save(self, rollout_id: int, num_rollout: int) -> None:
        """Save every role's part of a checkpoint, unpublished: `publish_checkpoint` makes it the one a resume
        starts from, after the rollout's metrics are written (no trained rollout then lacks its row)."""
        last = rollout_id + 1 == num_rollout
        interval = self.config.megatron.save_interval
        periodic = bool(interval and (rollout_id + 1) % interval == 0)
        if self.trainers is None:
            return
        if self.config.megatron.save and (last or periodic):
            if rollout_id in self.data_state_after:  # async runs have generated further by now
                state = {"data_source": self.data_state_after[rollout_id]}
            else:
                state = {"data_source": control(self.manager.data_source_state.remote(),
                                                "the data source's position")}
            self.trainers.save(rollout_id, state)
            if self.critic is not None:
                self.critic.save(rollout_id, {})
            self.unpublished = rollout_id
        if self.config.train.save_hf and (last or periodic):
            self.trainers.save_hf(self.config.train.save_hf.format(rollout_id=rollout_id))

    def publish_checkpoint(self) -> None:
        """Publish the checkpoint `maybe_save` wrote (one marker for actor, critic and vime's state), then let the
        stored rollouts it holds go."""
        rollout_id, self.unpublished = self.unpublished, None
        if rollout_id is None:
            return
        self.trainers.publish_checkpoint(rollout_id, ["actor"] + (["critic"] if self.critic is not None else []))
        # rollouts up to here are inside the checkpoint: no resume will replay them
        self.transport.trim([i for i in self.transport.stored() if i <= rollout_id])
        self.data_state_after = {i: s for i, s in self.data_state_after.items() if i > rollout_id}

    def maybe_eval(self, rollout_id: int, force: bool = False) -> None:
        interval = self.config.eval.eval_interval
        if self.use_engines and interval and (force or rollout_id % interval == 0):
            self.metrics.log(rollout_id, self._wait_for_rollout(self.manager.eval.remote(rollout_id), "eval"))

    def __exit__(self, *exc) -> None:
        curve = None
        if self.metrics is not None:  # every row is written: the curve is drawn while the actors stop
            self.metrics.close()
            curve = threading.Thread(target=save_reward_curve, args=(self.config.job.output_dir,), name="reward-curve")
            curve.start()
        try:
            if self.manager is not None and not self.manager_stuck:  # a stuck one takes no call: it is killed below
                ray.get(self.manager.shutdown.remote(), timeout=120)
        finally:
            # the manager (its router and the engines it restarted go with it), the engines made here for it, the
            # trainers and the devices: nothing stays on a cluster that outlives the run (--ray-address, or a
            # process that runs several)
            for actor in [a for a in (self.manager, *self.engines) if a is not None]:
                ray.kill(actor)
            for group in self._train_groups():
                group.shutdown()
            if self.placement is not None:
                self.placement.release()
            if curve is not None:
                curve.join()
            self.transport.close()
            self.run_lock.__exit__()
