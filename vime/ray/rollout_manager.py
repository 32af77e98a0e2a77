"""The rollout manager (a Ray actor): owns the engines, the router, the prompt data and the rollout function.

    manager = RolloutManager.remote(args, pg)
    handle = ray.get(manager.generate.remote(rollout_id))  # -> transport.get(handle): (sample dicts, extra)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from vime.backends.vllm_utils import client
from vime.backends.vllm_utils.arguments import router_args_from
from vime.backends.vllm_utils.engine import VLLMEngine
from vime.backends.vllm_utils.router import Router, post_worker
from vime.data.data_source import RolloutDataSource
from vime.data.transport import make_transport
from vime.data.prompt_dataset import load_prompt_samples
from vime.ray.placement import num_engines, serving_host
from vime.rollout.debug_data import load_rollout, save_rollout
from vime.rollout.metrics import rollout_metrics
from vime.utils.misc import find_free_port, load_function
from vime.utils.types import Sample

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class RolloutManager:
    def __init__(self, args, placement=None):
        self.args = args
        self.log_dir = Path(args.output_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engines: list = []
        self.router: Router | None = None
        self.engine_urls: list[str] = []
        self.weight_version = 0
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.data_source = None
        if args.prompt_data:
            prompts = load_prompt_samples(args.prompt_data, self.tokenizer, args)
            buffer_filter = None
            if args.buffer_filter_path:
                fn = load_function(args.buffer_filter_path)
                buffer_filter = lambda buffer, n: fn(args, buffer, n)  # noqa: E731
            self.data_source = RolloutDataSource(prompts, args.n_samples_per_prompt, args.rollout_seed,
                                                 args.rollout_shuffle, buffer_filter)
        self.eval_sources = {}
        for name, path in zip((args.eval_prompt_data or [])[::2], (args.eval_prompt_data or [])[1::2]):
            prompts = load_prompt_samples(path, self.tokenizer, args)
            self.eval_sources[name] = RolloutDataSource(prompts, args.n_samples_per_eval_prompt, args.rollout_seed,
                                                        shuffle=False)
        self.rollout_fn = load_function(args.rollout_function_path)
        self.eval_fn = load_function(args.eval_function_path or args.rollout_function_path)
        self.placement = placement
        self.transport = make_transport(args)  # how generate() hands rollouts to the trainer side

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Start (or connect to) the engines and the router; returns the engine URLs."""
        args = self.args
        if args.rollout_external_engine_addrs:
            self.engine_urls = [f"http://{a}" for a in args.rollout_external_engine_addrs]
        else:
            actor_cls = ray.remote(VLLMEngine)
            for rank in range(num_engines(args)):
                options = {"num_cpus": 1}
                if self.placement is not None and self.placement.pg is not None:
                    bundle = self.placement.rollout_offset + rank * args.rollout_num_gpus_per_engine
                    options = self.placement.actor_options(bundle)
                self.engines.append(actor_cls.options(**options).remote(args, rank, str(self.log_dir)))
            self.engine_urls = ray.get([e.start.remote() for e in self.engines])
        self._start_router()
        args.rollout_engine_urls = self.engine_urls
        logger.info("engines %s behind router %s", self.engine_urls, self.router_url)
        return self.engine_urls

    def _start_router(self) -> None:
        args = self.args
        if args.vllm_router_ip:  # an external router: register our engines with it
            self.router_url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
            for url in self.engine_urls:
                post_worker(self.router_url, "add_worker", url)
            return  # not ours to stop
        host = serving_host(args)
        port = args.vllm_router_port or find_free_port()
        self.router = Router(router_args_from(args, host, port, self.engine_urls), str(self.log_dir))
        self.router_url = self.router.start()
        args.vllm_router_ip, args.vllm_router_port = host, port

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.engines:
            ray.get([e.stop.remote() for e in self.engines])
            for e in self.engines:
                ray.kill(e)
            self.engines = []

    def engine_pids(self) -> list[int]:
        return ray.get([e.pid.remote() for e in self.engines])

    def router_pid(self) -> int | None:
        return self.router.proc.pid if self.router and self.router.proc else None

    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def get_router_url(self) -> str:
        return self.router_url

    # ---- rollouts --------------------------------------------------------------------------------------------
    def generate(self, rollout_id: int):
        """One rollout, handed to the data transport; returns its handle.

        `transport.get(handle)` gives (groups of sample dicts, extra), where extra holds the rollout id, its
        metrics and the data-source state right after it (what a resumed run needs to continue after it).
        """
        args = self.args
        start = time.perf_counter()
        if args.load_debug_rollout_data:
            groups = load_rollout(args.load_debug_rollout_data, rollout_id)
            stats = {}
        else:
            groups = self.rollout_fn(args, rollout_id, self.data_source)
            stats = getattr(args, "last_rollout_stats", {}) or {}
        elapsed = time.perf_counter() - start
        if args.save_debug_rollout_data:
            save_rollout(args.save_debug_rollout_data, rollout_id, groups)
        samples = [s for g in groups for s in g]
        metrics = rollout_metrics(samples, args)
        metrics["rollout/time"] = elapsed
        metrics["rollout/tokens_per_s"] = metrics["rollout/response_tokens"] / max(elapsed, 1e-9)
        for key in ("dropped_groups", "aborted_groups", "submitted_groups"):
            if key in stats:
                metrics[f"rollout/{key}"] = float(stats[key])
        extra = {"rollout_id": rollout_id, "metrics": metrics, "data_source": self.data_source_state()}
        return self.transport.put(rollout_id, [[s.to_dict() for s in g] for g in groups], extra)

    def eval(self, rollout_id: int) -> dict[str, float]:
        if not self.eval_sources:
            return {}
        results = self.eval_fn(self.args, rollout_id, self.eval_sources, evaluation=True)
        metrics = {}
        for name, samples in results.items():
            m = rollout_metrics(samples, self.args, prefix=f"eval/{name}")
            metrics.update(m)
        return metrics

    # ---- engine control (every engine, never through the router) ---------------------------------------------
    def pause(self, mode: str = "wait") -> None:
        client.pause(self.engine_urls, mode)

    def resume(self) -> None:
        client.resume(self.engine_urls)

    def abort(self) -> None:
        client.abort_all(self.engine_urls)

    def sleep(self) -> None:
        """Free engine memory while the trainer uses the shared devices (--colocate --offload-rollout)."""
        client.post_all(self.engine_urls, "/sleep", params={"level": 1})

    def wake_up(self) -> None:
        client.post_all(self.engine_urls, "/wake_up")

    def reset_prefix_cache(self) -> None:
        client.reset_prefix_cache(self.engine_urls)

    def apply_weights(self, transport, handle, version: int) -> None:
        """Load new weights into every (paused) engine, then make them visible and resume."""
        transport.apply(self.engine_urls, handle)
        client.reset_prefix_cache(self.engine_urls)
        self.set_weight_version(version)
        client.resume(self.engine_urls)

    def set_weight_version(self, version) -> None:
        self.weight_version = version
        client.update_weight_version(self.engine_urls, str(version))

    def probe_log_probs(self, tokens: list[int]) -> list[list[float]]:
        """Every engine's prompt log-probs of `tokens` (for --check-weight-update-equal)."""
        from vime.backends.weight_transport.check import engine_prompt_log_probs

        return engine_prompt_log_probs(self.engine_urls, tokens)

    def data_source_state(self) -> dict | None:
        return self.data_source.state_dict() if self.data_source else None

    def load_data_source_state(self, state: dict) -> None:
        if self.data_source is not None and state:
            self.data_source.load_state_dict(state)

    def num_prompts(self) -> int:
        return len(self.data_source.prompts) if self.data_source else 0


def samples_from_dicts(groups: list[list[dict]]) -> list[list[Sample]]:
    return [[Sample.from_dict(d) for d in g] for g in groups]
