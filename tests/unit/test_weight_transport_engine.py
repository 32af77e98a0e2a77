"""Weight transports on the real stack: one vLLM engine (started with vime's worker extension) and the real
Megatron trainer in this process, driven by the real `WeightSync.update` and `check_weights_equal` (Ray's
`.remote` / `get` / `wait` stand-ins run the calls on threads: no Ray cluster; `tests.helpers.weight_sync_driver`).
Each transport gets weights the engine does not have (noise added to the trainer's parameters); afterwards the
engine's prompt log-probs of a probe sequence must equal the trainer's within 1e-5 (float32), and must have
differed before. Also: the broadcast group's reuse, delta's changed layers, the one-call update and its fallback,
the worker's sleep, an in-flight update.
"""

from __future__ import annotations

import argparse
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.run_sections import weight_sync_of
from tests.helpers.weight_sync_driver import ARGV, driver, fake_ray, probe_for  # noqa: F401

pytest.importorskip("megatron.core")

from vime.transport.weights.broadcast.driver import engine_set_key  # noqa: E402
from vime.transport.weights.check import (FLOAT32_TOLERANCE, WeightUpdateMismatchError,  # noqa: E402
                                                  check_weights_equal, compare_log_probs, engine_prompt_log_probs)
from vime.driver.weight_sync import WeightSync  # noqa: E402
from vime.utils.auth import RunToken  # noqa: E402

TOKEN = RunToken.new()  # the engine's, which every call to it carries


@pytest.fixture(scope="module")
def trainer_side(tiny_qwen3, tmp_path_factory):
    """(args, trainer): the real Megatron trainer in this process."""
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.arguments import parse_args

    out = tmp_path_factory.mktemp("weight_transport")
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *ARGV, "--output-dir", str(out),
                       "--update-weight-dir", str(out)])
    trainer = MegatronTrainer(args)
    try:
        yield args, trainer
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def engine(trainer_side):
    """The started engine (a `VLLMEngine`), after the trainer: the trainer's rendezvous port and the booting
    engine's internal ports are picked free-then-bound, and overlapping the two has collided."""
    from vime.engine.control.engine import VLLMEngine

    args, _ = trainer_side
    engine = VLLMEngine(args, 0, args.output_dir, TOKEN)
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def stack(trainer_side, engine):
    """(args, trainer, engine url)."""
    return (*trainer_side, engine.url)


@pytest.fixture
def sync(stack, fake_ray):
    """sync(transport name, version) -> what delta wrote; runs the real `WeightSync.update`, one driver-side
    `WeightSync` per transport as a run keeps it."""
    args, trainer, url = stack
    group, manager, state = driver(trainer, [url], fake_ray, TOKEN)
    syncs: dict[str, WeightSync] = {}

    def push(name: str, version: int, in_flight: bool = False) -> list[str]:
        state.written = []
        if name not in syncs:
            syncs[name] = weight_sync_of(argparse.Namespace(**{**vars(args), "update_weight_transport": name}))
        syncs[name].update(group, manager, version, in_flight=in_flight)
        return state.written

    push.check = lambda: check_weights_equal(args, group, manager)
    push.answers = lambda: state.answers  # the engines' answers to the last update
    push.driver = lambda name: syncs[name].transport  # the transport's driver half
    push.writer = lambda name: group.actors[0]._obj.weight_transports[name]  # the training rank's half
    yield push
    for transport in group.actors[0]._obj.weight_transports.values():
        if hasattr(transport, "close"):
            transport.close()


_seeds = itertools.count()


def _perturb(trainer, only: dict[str, slice] | None = None, scale: float = 0.02) -> None:
    """Noise on every parameter, or on the given rows of the named Megatron parameters only."""
    g = torch.Generator().manual_seed(next(_seeds))
    with torch.no_grad():
        for chunk in trainer.model:
            for name, p in chunk.module.named_parameters():
                if only is None:
                    p.add_(torch.randn(p.shape, generator=g) * scale)
                elif name in only:
                    rows = p[only[name]]
                    rows.add_(torch.randn(rows.shape, generator=g) * scale)


def _max_diff(trainer, url: str, tokens: list[int]) -> float:
    ours = trainer.probe_log_probs(tokens, len(tokens) - 1, temperature=1.0)
    theirs = engine_prompt_log_probs(TOKEN, [url], tokens)[0]
    return compare_log_probs(ours, [theirs], [url], float("inf"))["weight_check/max_abs_logprob_diff"]


@pytest.mark.parametrize("name", ["disk", "broadcast", "delta"])
def test_transport_makes_the_engine_serve_the_trainers_weights(stack, sync, name):
    args, trainer, url = stack
    tokens = probe_for(args.hf_checkpoint)
    _perturb(trainer)
    assert _max_diff(trainer, url, tokens) > 1e-3  # the engine does not have these weights yet
    with pytest.raises(WeightUpdateMismatchError, match=url):
        sync.check()
    sync(name, version=1)
    assert sync.answers()[0]["results"][0]["in_place"] is True  # vime's loader, not vLLM's layerwise reload
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE
    assert sync.check()["weight_check/max_abs_logprob_diff"] <= FLOAT32_TOLERANCE


def test_broadcast_group_is_reused_and_rebuilt_for_new_engines(stack, sync):
    args, trainer, url = stack
    tokens = probe_for(args.hf_checkpoint)
    sync("broadcast", version=2)
    first = sync.writer("broadcast").group["pg"]
    _perturb(trainer)
    sync("broadcast", version=3)
    assert sync.writer("broadcast").group["pg"] is first  # same engines: same group
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE
    engine_set_key(sync.driver("broadcast").engine_set, ["http://another-engine"])  # the driver saw another set
    _perturb(trainer)
    sync("broadcast", version=4)
    assert sync.writer("broadcast").group["pg"] is not first  # rebuilt, on both sides
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE


def test_delta_sends_only_changed_layers_and_they_suffice(stack, sync):
    args, trainer, url = stack
    tokens = probe_for(args.hf_checkpoint)
    sync("delta", version=5)  # the engine now has what the trainer has
    assert sync("delta", version=6) == []  # nothing changed: nothing sent
    # Rows 0-7 of layer 1's linear_qkv are query rows only: HF q_proj changes, k_proj and v_proj do not.
    _perturb(trainer, {"decoder.layers.1.self_attention.linear_qkv.weight": slice(0, 8),
                       "decoder.final_layernorm.weight": slice(None)}, scale=0.2)
    assert _max_diff(trainer, url, tokens) > 1e-3
    written = sync("delta", version=7)
    assert sorted(written) == sorted([f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
                                     + ["model.norm.weight"])
    assert _max_diff(trainer, url, tokens) <= FLOAT32_TOLERANCE


def test_one_call_update_on_the_engine_and_its_fallback(stack, monkeypatch):
    """vime's route on the real engine: one POST pauses, loads, versions and resumes; a failed load names the
    route and leaves the engine paused; the separate-call fallback (engines without the plugin) does the same."""
    from vime.engine.control import client
    from vime.engine.protocol import names
    from vime.engine.protocol.names import UPDATE_ROUTE as ROUTE

    args, trainer, url = stack
    tokens = probe_for(args.hf_checkpoint)
    reload = {url: ("reload_weights", {"weights_path": args.hf_checkpoint})}

    def state() -> tuple[bool, str]:
        control = TOKEN.control_headers()
        return (client.http().get(url + "/is_paused", headers=control).json()["is_paused"],
                client.http().get(url + "/weight_info", headers=control).json()["weight_version"])

    try:
        with pytest.raises(client.EngineControlError, match=f"{ROUTE}.*vime_no_such_method"):
            client.update_weights_all(TOKEN, [url], {url: ("vime_no_such_method", {})}, 41)
        assert state()[0] is True  # not resumed after a failed load
        answer = client.update_weights_all(TOKEN, [url], reload, 42)[0]
        assert state() == (False, "42") and answer["timings"]["load_s"] > 0
        assert set(answer["timings"]) == {"pause_s", "load_s", "finish_s"}
        served = engine_prompt_log_probs(TOKEN, [url], tokens)[0]  # generation runs again: the checkpoint's weights

        monkeypatch.setattr(names, "UPDATE_ROUTE", "/vime_route_of_another_version")  # 404: the separate steps
        _perturb(trainer)  # nothing pushed: only the version moves, then the checkpoint again
        client.update_weights_all(TOKEN, [url], {}, 43)
        assert state() == (False, "43")
        client.update_weights_all(TOKEN, [url], reload, 44)
        assert state() == (False, "44")
        assert engine_prompt_log_probs(TOKEN, [url], tokens)[0] == pytest.approx(served, abs=FLOAT32_TOLERANCE)
    finally:
        client.resume(TOKEN, [url])


def test_engine_worker_sleeps_soon_after_a_call(stack, engine):
    """The engine computes idle soon after a call: no busy-wait of vLLM's (1 s of a core after each message between
    an engine core and a worker process, capped by vime's engine plugin; a one-worker CPU engine has none)."""
    import time

    from tests.e2e.processes import engine_compute_processes
    from vime.engine.control import client

    args, trainer, url = stack
    workers = engine_compute_processes(under=engine.pid())  # its own: other engines may run beside it
    assert len(workers) == 1

    def busy() -> float:
        t = workers[0].cpu_times()
        return t.user + t.system

    client.update_weights_all(TOKEN, [url], {}, 50)
    before = busy()
    time.sleep(1.0)
    assert busy() - before < 0.4  # vLLM's own 1 s spin costs a whole CPU-second here


def test_an_in_flight_update_switches_a_running_request_to_the_new_weights(stack, sync):
    """An update while the engine generates (train_async --update-weights-in-flight): the request is kept, its
    tokens carry two version spans, and every token after the update has exactly the new weights' log-prob on
    its whole context (the kept request's KV was recomputed, not reused from the old weights)."""
    import time

    from vime.engine.control import client

    args, trainer, url = stack
    prompt = probe_for(args.hf_checkpoint)[:8]
    sync("disk", version=50)  # the engine serves the trainer's weights
    body = {"token_ids": prompt, "model": "policy",
            "sampling_params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 1.0, "logprobs": 0}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: client.http().post(url + "/inference/v1/generate", json=body, timeout=300,
                                                         headers=TOKEN.serving_headers()))
        time.sleep(0.5)  # a few hundred of its 1500 decode steps
        _perturb(trainer, scale=0.05)
        sync("disk", version=51, in_flight=True)
        answer = pending.result(timeout=300)
    assert answer.status_code == 200, answer.text[:500]
    choice = answer.json()["choices"][0]
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["50", "51"], spans
    boundary = spans[0]["end"]
    assert 0 < boundary == spans[1]["start"] < spans[1]["end"] == 1500, spans
    engine = [c["logprob"] for c in choice["logprobs"]["content"]]
    new = trainer.probe_log_probs(prompt + choice["token_ids"], 1500, temperature=1.0)
    after = max(abs(a - b) for a, b in zip(engine[boundary:], new[boundary:]))
    before = max(abs(a - b) for a, b in zip(engine[:boundary], new[:boundary]))
    assert after <= 10 * FLOAT32_TOLERANCE, after  # sampled by the new weights, on a recomputed cache
    assert before > 1e-3, before  # sampled by the old ones
