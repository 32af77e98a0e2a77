"""The rollout manager (a Ray actor): produces rollouts (prompt data, eval sets, the rollout function, the data
transport, debug save and load) next to the engine fleet it hands the engines to (`vime.rollout_manager.engine_fleet`).

    manager = RolloutManager.remote(args, placement)
    ray.get(manager.start.remote())                              # the fleet: engines and router
    rollout = ray.get(manager.generate.remote(rollout_id))       # a RolloutRef: transport handle + JSON extra

The rollout function runs in this process, where the fleet keeps the rollout context (router URL, engines in
service, counters) that rollout code reads (`vime.rollout.context`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from vime.config.agents import EnvironmentConfig, JudgeConfig
from vime.data.adapter_mix import AdapterMixSource
from vime.data.data_source import RolloutDataSource
from vime.data.prompt_dataset import load_prompt_file, load_prompt_samples
from vime.data.slime_data_source import SlimeDataSource
from vime.engine.control import client
from vime.engine.control.spec_counters import rollout_spec_metrics
from vime.environments.judge import JudgeGroup, judge_engine_args
from vime.environments.mixture import environment_eval_sources, environment_source, load_environments
from vime.transport.weights.check import probe_tokens
from vime.config.rollout import (DataBufferConfig, EnginesConfig, EvalConfig, FaultToleranceConfig, PromptDataConfig,
                                 RolloutConfig)
from vime.config.run import DebugConfig, JobConfig
from vime.config.train import MegatronConfig
from vime.data.sample import ADAPTER_KEY, RolloutFnTrainOutput, Sample, as_rollout_output
from vime.rollout.context import RolloutContext, in_rollout_context, rollout_context, use_rollout_context
from vime.rollout.debug_data import load_rollout, save_compact_rollout, save_rollout
from vime.rollout.metrics import eval_at_k, record_counters, rollout_metrics
from vime.rollout.sandbox_runs import check_sandbox_runs
from vime.rollout.train_data import apply_train_data
from vime.rollout_manager.engine_fleet import EngineFleet, new_engine, run_control_token
from vime.rollout_manager.engine_health import FailedRollouts
from vime.transport.rollouts import RolloutRef, make_transport, rollout_summary
from vime.utils.auth import RunToken
from vime.utils.logging_utils import configure_logging
from vime.utils.lora_adapters import adapter_names, adapter_specs
from vime.utils.misc import load_function
from vime.utils.plugin_args import plugin_view, runtime_values

logger = logging.getLogger(__name__)


def resolve_num_rollout(args, num_prompts: int) -> int:
    """The run's rollout count: --num-rollout, else --num-epoch passes over `num_prompts` prompts."""
    job = JobConfig.of(args)
    prompt_data = PromptDataConfig.of(args)
    rollout = RolloutConfig.of(args)
    if job.num_rollout is not None:
        return job.num_rollout
    if prompt_data.num_epoch is not None:
        return max(1, prompt_data.num_epoch * num_prompts // rollout.rollout_batch_size)
    raise ValueError("set --num-rollout or --num-epoch")


def rollout_function(path: str):
    """The rollout function `path` names (--rollout-function-path, --eval-function-path): the default one imported
    by name, so that the edge from the manager to it is one an editor follows; any other loaded from its path."""
    from vime.rollout import vllm_rollout  # the rollout library's default, loaded when the manager starts

    if path == RolloutConfig().rollout_function_path:
        return vllm_rollout.generate_rollout
    return load_function(path)


def make_data_source(args, tokenizer, environments: list | None = None) -> RolloutDataSource | None:
    """The training prompts: the --environment mixture (`environments`, loaded), --prompt-data, or each adapter's
    file (--lora-adapters, `AdapterMixSource`); None without any (replayed rollouts). Malformed rows skipped and
    over-long prompts dropped, all files together, are reported with the next rollout (data/skipped_rows,
    data/too_long_prompts)."""
    prompt_data = PromptDataConfig.of(args)
    rollout = RolloutConfig.of(args)
    if rollout.data_source_path:  # slime's data source class, made as slime makes it
        return SlimeDataSource(load_function(rollout.data_source_path)(args), rollout.data_source_path,
                               saves=bool(MegatronConfig.of(args).save))
    if environments:
        return environment_source(environments, tokenizer, args, _buffer_filter(args))
    specs = adapter_specs(args)
    default = {None: prompt_data.prompt_data} if prompt_data.prompt_data else {}
    files = {s.name: s.prompt_data for s in specs} or default
    if not files:
        return None
    loaded = {name: load_prompt_file(path, tokenizer, args) for name, path in files.items()}
    record_counters({"data/skipped_rows": float(sum(len(f.skipped) for f in loaded.values())),
                     "data/too_long_prompts": float(sum(f.too_long for f in loaded.values()))})
    buffer_filter = _buffer_filter(args)
    if specs:
        return AdapterMixSource({name: f.samples for name, f in loaded.items()}, rollout.n_samples_per_prompt,
                                rollout.rollout_seed, prompt_data.rollout_shuffle, buffer_filter)
    return RolloutDataSource(loaded[None].samples, rollout.n_samples_per_prompt, rollout.rollout_seed,
                             prompt_data.rollout_shuffle, buffer_filter)


def _buffer_filter(args):
    rollout = RolloutConfig.of(args)
    if not rollout.buffer_filter_path:
        return None
    fn = load_function(rollout.buffer_filter_path)
    # the filter gets the plugin view (the rollout context's, made once the data is loaded), as every hook
    return lambda buffer, n: fn(rollout_context().plugin_args or args, buffer, n)


def make_eval_sources(args, tokenizer) -> dict[str, RolloutDataSource]:
    """{name: source} of --eval-prompt-data NAME PATH ...; in a multi-LoRA run each set is named after the adapter
    it evaluates (validation refuses other names), and its samples are tagged with it."""
    evaluation = EvalConfig.of(args)
    rollout = RolloutConfig.of(args)
    adapters = set(adapter_names(args))
    sources = {}
    for name, path in zip((evaluation.eval_prompt_data or [])[::2], (evaluation.eval_prompt_data or [])[1::2]):
        prompts = load_prompt_samples(path, tokenizer, args)
        if name in adapters:
            for prompt in prompts:
                prompt.metadata[ADAPTER_KEY] = name
        sources[name] = RolloutDataSource(prompts, evaluation.n_samples_per_eval_prompt, rollout.rollout_seed,
                                          shuffle=False)
    return sources


def save_copy(what: str, save, *args) -> bool:
    """`save(*args)`, a copy of a rollout kept to look at: a full disk or an unwritable folder is logged and
    returns False, and the rollout goes on (it is trained on all the same; its metrics count the failure)."""
    try:
        save(*args)
        return True
    except OSError as e:
        logger.error("could not save %s (%s: %s); the rollout is kept and trained on. Free space there, or turn "
                     "the copies off (--no-save-rollouts; no --save-debug-rollout-data)", what, type(e).__name__, e)
        return False


def log_dir(args) -> Path:
    """Where the engines' and the router's logs go."""
    job = JobConfig.of(args)
    return Path(job.output_dir) / "logs"


# every other call runs one at a time in the default group; a weight update has its own thread
# each public method runs with the run's rollout context current (what rollout code and custom functions read)
@ray.remote(num_cpus=0, concurrency_groups={"weights": 1})
@in_rollout_context
class RolloutManager:
    def __init__(self, args, placement=None, engines: list | None = None, token: RunToken | None = None):
        """`engines`: actors made for it by `engine_fleet.new_engines` with the run's control `token`; without
        them its fleet makes its own. Without `token` it makes the run's (`run_control_token`)."""
        configure_logging()  # an actor process: its log lines reach the driver's console through Ray
        self.args = args
        self.log_dir = log_dir(args)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # router URL, engines in service, the run's token, counters: what rollouts read
        self.context = RolloutContext(token=token if token is not None else run_control_token(args))
        with use_rollout_context(self.context):
            self._set_up(args, placement, engines)

    def _set_up(self, args, placement, engines: list | None) -> None:
        debug = DebugConfig.of(args)
        judge = JudgeConfig.of(args)
        job = JobConfig.of(args)
        environments_flags = EnvironmentConfig.of(args)
        rollout = RolloutConfig.of(args)
        evaluation = EvalConfig.of(args)
        fault_tolerance = FaultToleranceConfig.of(args)
        prompt_data = PromptDataConfig.of(args)
        self.fleet = EngineFleet(args, placement, self.log_dir, self.context, engines)
        if not debug.debug_train_only:
            self.fleet.launch()  # the engines boot while the tokenizer, data and functions load
        # --judge-checkpoint: the judge's own engines, never in the fleet (no weight update reaches them)
        if judge.judge_checkpoint and not debug.debug_train_only:
            judge_args = judge_engine_args(args)
            token = self.context.token
            judge_engines = [new_engine(judge_args, placement, i, self.log_dir, token, role="judge")
                             for i in range(judge.judge_num_engines)]
            self.context.judge = JudgeGroup(args, judge_engines, token)
        from vime.utils.hf_tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(job.hf_checkpoint)
        # --environment: the environments' prompts, evals, rewards and turns (the hooks find them in the context)
        environments = load_environments(args) if environments_flags.environment else []
        self.context.environments = {env.name: env for env in environments}
        self.data_source = make_data_source(args, self.tokenizer, environments)
        self.eval_sources = {**make_eval_sources(args, self.tokenizer),
                             **environment_eval_sources(environments, self.tokenizer, args)}
        self.rollout_fn = rollout_function(rollout.rollout_function_path)
        self.eval_fn = rollout_function(evaluation.eval_function_path or rollout.rollout_function_path)
        # slime's hooks around them: the conversion to training data, the rollout's and the eval's logging
        self.hooks = {name: load_function(path) if path else None for name, path in (
            ("convert", rollout.custom_convert_samples_to_train_data_path),
            ("log_rollout", rollout.custom_rollout_log_function_path),
            ("log_eval", evaluation.custom_eval_rollout_log_function_path))}
        self.transport = make_transport(DataBufferConfig.of(args))  # how generate() hands rollouts to the trainer side
        self.failures = FailedRollouts(fault_tolerance.max_failed_samples_ratio,
                                       fault_tolerance.max_consecutive_failed_rollouts)
        # what every custom function receives as `args`: the flags and the run's values (vime.utils.plugin_args)
        has_length = job.num_rollout is not None or prompt_data.num_epoch is not None
        self.context.plugin_args = plugin_view(
            args, self.fleet.plugin_router_url(),
            resolve_num_rollout(args, self.num_prompts()) if has_length else None, EnginesConfig.of(args).num_engines())

    @property
    def plugin_args(self):
        return self.context.plugin_args

    def plugin_values(self) -> dict:
        """The run-time values of the plugin view, for the trainers' custom functions (`plugin_view_from`)."""
        return runtime_values(self.context.plugin_args)

    # ---- the engine fleet (its remote interface) ------------------------------------------------------------
    def start(self) -> list[str]:
        """Start (or connect to) the engines and the router (and the judge's engines); returns the engine URLs."""
        urls = self.fleet.start()
        if self.context.judge is not None:
            logger.info("judge engines at %s", ", ".join(self.context.judge.start()))
        return urls

    def shutdown(self) -> None:
        try:
            self.fleet.shutdown()
        finally:
            if self.context.judge is not None:
                self.context.judge.stop()
            for env in self.context.environments.values():  # servers an environment started (no rollout is left)
                env.close()
            self.context.close()  # reward workers, the agents' endpoint

    # The fleet's own verbs. In the "weights" group: beside a rollout in progress; an in-flight update (train_async)
    # asks for the engines first, then applies.
    def engine_pids(self) -> list[int]:
        """Each engine's server process id."""
        return self.fleet.engine_pids()

    @ray.method(concurrency_group="weights")
    def get_engine_urls(self) -> list[str]:
        return list(self.fleet.engine_urls)

    @ray.method(concurrency_group="weights")
    def get_live_engine_urls(self) -> list[str]:
        """The engines in service, after a probe of each."""
        return self.fleet.recovery.live_engine_urls()

    def get_router_url(self) -> str | None:
        return self.fleet.router_url

    def sleep(self) -> None:
        """--offload-rollout: every engine frees its device memory."""
        self.fleet.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The engines' memory back: `tags` ("weights", "kv_cache"), or all of it."""
        self.fleet.wake_up(tags)

    @ray.method(concurrency_group="weights")
    def apply_weights(self, transport, handle, version: int, recovery_dir: str | None = None,
                      pause_mode: str = "wait") -> dict[str, float]:
        """Every engine loads `transport`'s update as weight `version` (`EngineFleet.apply_weights`)."""
        return self.fleet.apply_weights(transport, handle, version, recovery_dir, pause_mode)

    def set_recovery_weights(self, path: str) -> None:
        self.fleet.recovery.set_recovery_weights(path)

    def engine_restarts(self) -> int:
        return self.fleet.recovery.engine_restarts()

    def router_restarts(self) -> int:
        return self.fleet.recovery.router_restarts()

    def probe_log_probs(self, tokens: list[int], model: str = client.SERVED_MODEL) -> list[list[float]]:
        """Every engine's prompt log-probs of `tokens` (--check-weight-update-equal)."""
        return self.fleet.probe_log_probs(tokens, model)

    def probe_tokens(self) -> list[int]:
        return probe_tokens(len(self.tokenizer))

    # ---- rollouts --------------------------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> RolloutRef:
        """One rollout, handed to the data transport; returns its `RolloutRef`.

        The training ranks read the samples with `transport.get(ref.handle)`. `ref.extra` (stored with them)
        holds the rollout id, its metrics, the sample ids and weight versions, the data-source state right
        after it (what a resumed run needs to continue after it) and, when too many of its samples failed, why it
        must not be trained on (`skip_reason`, see `FailedRollouts`).
        """
        args = self.args
        debug = DebugConfig.of(args)
        start = time.perf_counter()
        self.fleet.recovery.reconcile_router()
        counters = None if debug.load_debug_rollout_data else self.fleet.spec_counters()
        if debug.load_debug_rollout_data:
            output = RolloutFnTrainOutput(load_rollout(debug.load_debug_rollout_data, rollout_id))
        else:
            output = as_rollout_output(self.rollout_fn(self.plugin_args, rollout_id, self.data_source),
                                       evaluation=False)
        groups = output.samples
        elapsed = time.perf_counter() - start
        save_errors = 0
        if debug.save_debug_rollout_data:
            save_errors += not save_copy(f"rollout {rollout_id} to --save-debug-rollout-data", save_rollout,
                                         debug.save_debug_rollout_data, rollout_id, groups)
        samples = [s for g in groups for s in g]
        if self.hooks["convert"] is not None:  # slime's conversion in place of the default one
            apply_train_data(samples, self.hooks["convert"](self.plugin_args, samples),
                             RolloutConfig.of(args).custom_convert_samples_to_train_data_path)
        metrics = rollout_metrics(samples, args)
        metrics["rollout/time"] = elapsed
        metrics["rollout/tokens_per_s"] = metrics["rollout/response_tokens"] / max(elapsed, 1e-9)
        if counters is not None:  # speculative rollout: its drafts accepted, from the engines' counters
            metrics.update(rollout_spec_metrics(counters, self.fleet.spec_counters()))
        metrics.update(output.metrics or {})
        skip_reason = self._judge(rollout_id, metrics)
        if self.hooks["log_rollout"] is not None and self.hooks["log_rollout"](
                rollout_id, self.plugin_args, samples, output.metrics, elapsed):
            # True: the function logged the rollout itself; vime keeps only what its own loop reads
            metrics = {k: v for k, v in metrics.items() if not k.startswith("rollout/") or k == "rollout/time"}
        if isinstance(self.data_source, SlimeDataSource):
            self.data_source.after_rollout(rollout_id)
        dicts = [[s.to_dict() for s in g] for g in groups]
        save_errors += not save_copy(f"rollout {rollout_id} to <output-dir>/rollouts", self._keep_for_inspection,
                                     f"rollout_{rollout_id}", dicts)
        if save_errors:
            metrics["rollout/save_errors"] = float(save_errors)
        check_sandbox_runs(samples, f"rollout {rollout_id}")  # all its sandboxed runs failed: stop, kept to inspect
        extra = {"rollout_id": rollout_id, "metrics": metrics, "data_source": self.data_source_state(),
                 **rollout_summary(dicts)}
        if skip_reason is not None:
            extra["skip_reason"] = skip_reason
        return RolloutRef(self.transport.put(rollout_id, dicts, extra), extra)

    def _judge(self, rollout_id: int, metrics: dict[str, float]) -> str | None:
        """Why rollout `rollout_id` must not be trained on (too many failed samples), or None; adds its failed
        ratio to `metrics`. A failed rollout has the router and engines probed now rather than at the next
        interval (--use-fault-tolerance): a dead one is restarted sooner."""
        failed, total = int(metrics["rollout/failed_samples"]), int(metrics["rollout/num_samples"])
        metrics["rollout/failed_ratio"] = failed / total if total else 1.0
        reason = self.failures.judge(rollout_id, failed, total)
        if reason is not None:
            logger.error("%s: it will not be trained on", reason)
            self.fleet.recovery.check_soon()
        return reason

    def eval(self, rollout_id: int) -> dict[str, float]:
        evaluation = EvalConfig.of(self.args)
        debug = DebugConfig.of(self.args)
        if not self.eval_sources:
            return {}
        self.fleet.recovery.reconcile_router()
        output = as_rollout_output(self.eval_fn(self.plugin_args, rollout_id, self.eval_sources, evaluation=True),
                                   evaluation=True)
        metrics = dict(output.metrics or {})
        log_eval = self.hooks["log_eval"]
        logged = log_eval is not None and log_eval(rollout_id, self.plugin_args, {name: {
            "rewards": [s.get_reward_value(self.plugin_args) if s.reward is not None else 0.0 for s in samples],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples], "samples": samples}
            for name, samples in output.data.items()}, output.metrics)
        for name, samples in output.data.items():
            metrics.update(rollout_metrics(samples, self.args, prefix=f"eval/{name}"))
            if evaluation.eval_pass_at_k:
                metrics.update(eval_at_k(samples, self.args, evaluation.eval_pass_at_k, prefix=f"eval/{name}"))
            save_errors = 0
            if debug.save_debug_rollout_data:  # beside the training rollouts: eval_<name>_<rollout id>
                template = debug.save_debug_rollout_data.replace("{rollout_id}", f"eval_{name}_{{rollout_id}}")
                save_errors += not save_copy(f"eval {name!r} at rollout {rollout_id} to --save-debug-rollout-data",
                                             save_rollout, template, rollout_id, [samples])
            save_errors += not save_copy(f"eval {name!r} at rollout {rollout_id} to <output-dir>/rollouts",
                                         self._keep_for_inspection, f"eval_{name}_{rollout_id}", [samples])
            if save_errors:
                metrics[f"eval/{name}/save_errors"] = float(save_errors)
            check_sandbox_runs(samples, f"eval {name!r} at rollout {rollout_id}")
        return dict(output.metrics or {}) if logged else metrics  # True: the function logged it (slime's)

    def _keep_for_inspection(self, name: str, groups) -> None:
        """The compact copy in <output-dir>/rollouts/ (`python -m vime.inspect`), unless --no-save-rollouts."""
        debug = DebugConfig.of(self.args)
        job = JobConfig.of(self.args)
        if not debug.save_rollouts:
            return
        if save_compact_rollout(job.output_dir, name, groups, debug.save_rollouts_max_mb) is None:
            logger.warning("%s alone is over --save-rollouts-max-mb %s; not kept in %s/rollouts", name,
                           debug.save_rollouts_max_mb, job.output_dir)

    def data_source_state(self) -> dict | None:
        return self.data_source.state_dict() if self.data_source is not None else None

    def load_data_source_state(self, state: dict) -> None:
        if self.data_source is not None and state:
            self.data_source.load_state_dict(state)

    def num_prompts(self) -> int:
        return len(self.data_source) if self.data_source is not None else 0
