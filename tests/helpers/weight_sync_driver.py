"""The driver's side of a weight update without a Ray cluster, for the weight-transport tests: `handle.method.remote`
runs the call on a thread and returns a future (`fake_ray` makes `ray.get` / `ray.wait` take those), `Manager` is
the rollout manager's weight-related methods for one engine list, `driver` the train group and manager as the
driver sees them. The engines and the trainer behind them are real."""

from __future__ import annotations

from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from tests.helpers.run_sections import weight_sync_of
from vime.transport.weights.check import engine_prompt_log_probs, probe_tokens
from vime.utils.auth import RunToken

EXTENSION = "vime.engine.in_vllm.worker_extension.WeightReceiver"  # spelled out: what vLLM is given
ARGV = ["--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl", "--rm-type", "math",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--micro-batch-size", "2",
        "--update-weight-transport", "broadcast", "--update-weight-buffer-size", str(64 * 1024),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "2048"]


class Handle:
    def __init__(self, obj, pool):
        self._obj, self._pool = obj, pool

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *a, **k: self._pool.submit(method, *a, **k))


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    def get(refs, timeout=None):
        return [r.result(timeout=120) for r in refs] if isinstance(refs, list) else refs.result(timeout=120)

    def wait_some(refs, num_returns=1, timeout=None):
        when = ALL_COMPLETED if num_returns == len(refs) else FIRST_COMPLETED
        done, _ = wait(refs, timeout=min(120, timeout or 120), return_when=when)
        ready = [r for r in refs if r in done][:num_returns]
        return ready, [r for r in refs if r not in ready]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait_some)
    with ThreadPoolExecutor(8) as pool:
        yield pool


def probe_for(hf_checkpoint: str) -> list[int]:
    """The weight check's probe for this checkpoint's tokenizer (as RolloutManager.probe_tokens makes it)."""
    from transformers import AutoTokenizer

    return probe_tokens(len(AutoTokenizer.from_pretrained(hf_checkpoint)))


class Manager:
    """The rollout manager's weight-related methods (as in RolloutManager), for one engine list."""

    def __init__(self, urls: list[str], hf_checkpoint: str, token: RunToken):
        self.urls, self.written, self.hf_checkpoint = urls, [], hf_checkpoint
        self.token = token  # the engines' (as the rollout manager holds the run's)

    def get_engine_urls(self):
        return list(self.urls)

    get_live_engine_urls = get_engine_urls  # (the probe of each engine is EngineFleet's, tested on its own)

    def probe_tokens(self):
        return probe_for(self.hf_checkpoint)

    def apply_weights(self, transport, handle, version, recovery_dir=None, pause_mode="wait"):
        from vime.engine.control import client

        if isinstance(handle, dict) and "dir" in handle:  # delta: remember what it wrote
            for f in sorted(Path(handle["dir"]).glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    self.written += list(st.keys())
        answers = client.update_weights_all(self.token, self.urls, transport.load_calls(self.urls, handle), version,
                                            pause_mode)
        self.answers = answers
        return answers[0]["timings"] if answers else {}

    def probe_log_probs(self, tokens, model):
        return engine_prompt_log_probs(self.token, self.urls, tokens, model=model)


def update_weights(args, group, manager, version: int, after=None) -> dict:
    """One update through a new driver-side `WeightSync` (what a run holds for its whole length)."""
    return weight_sync_of(args).update(group, manager, version, after=after)


def driver(trainer, urls: list[str], pool, token: RunToken | None = None):
    """(train group, rollout manager) as the driver sees them; `token`: the engines' (None: no engines)."""
    from vime.driver.train_group import TrainActor

    actor = TrainActor(trainer.args, 0, 1)
    actor.trainer = trainer
    group = SimpleNamespace(actors=[Handle(actor, pool)],
                            probe_log_probs=lambda *a, **k: [actor.probe_log_probs(*a, **k)],
                            compute_kind=actor.compute_kind)
    manager = Manager(urls, trainer.args.hf_checkpoint, token or RunToken.new())
    return group, Handle(manager, pool), manager
