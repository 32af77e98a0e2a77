"""Engines under load and under fire, on the real stack: 2 vLLM engines behind vllm-router, driven through the
RolloutManager actor with --use-fault-tolerance.

1. 256 requests in flight: one rollout of 64 prompts x 4 with --rollout-concurrency 256 and
   --vllm-max-num-seqs 32 (requests queue inside the engines): every sample comes back complete, no request
   was retried or timed out, 256 requests were in flight at once (rollout/max_in_flight) and the engines held
   more than they run at once (running + waiting, from their /metrics).
2. The run's token: every control route of both engines answers 401 without it (also with a wrong key or the
   serving key, and when sent through the router, which stays on loopback), opens with it, and a weight load
   from outside the run's weight root is refused.
3. A SIGKILLed engine: new weights (version 1) are pushed, one engine's server is SIGKILLed in the middle of a
   rollout; the rollout completes with every group, the engine is back (new URL, healthy, in the router's
   /workers) within the health-check window plus its start-up time, serving version 1 with the same weights as
   the other engine, and the next rollout's metrics count the restart.
4. A SIGKILLed router: killed in the middle of a rollout, whose samples then fail; the rollout reports its failed
   ratio and is judged untrainable (`skip_reason`), so the session's train step skips it; the health monitor starts
   a new router (answers /health, both engines in its /workers) and the next rollout completes without failures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids
from tests.helpers.http_calls import http_status
from vime.utils.auth import RunToken

pytestmark = pytest.mark.e2e

CONCURRENCY = 256
HEALTH_INTERVAL, HEALTH_TIMEOUT = 2.0, 5.0
TOKEN = RunToken.new()  # the run's (--control-token-file): this test process calls the engines as the run does


def _in_engine(url: str) -> float:
    """Requests an engine holds now (running + waiting), from its Prometheus /metrics."""
    request = urllib.request.Request(url + "/metrics", headers=TOKEN.control_headers())
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


def _router_workers(router_url: str) -> list[str]:
    with urllib.request.urlopen(urllib.request.Request(router_url + "/workers", headers=TOKEN.serving_headers()),
                                timeout=10) as r:
        data = json.loads(r.read())
    return sorted(w["url"] if isinstance(w, dict) else w for w in data.get("workers", data.get("urls", [])))


def _server_pid(watchdog_pid: int) -> int:
    import psutil

    for p in psutil.Process(watchdog_pid).children(recursive=True):
        if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
            return p.pid
    raise AssertionError(f"no vLLM server under engine process {watchdog_pid}")


def _rollout(manager, args, rollout_id: int):
    """(groups of sample dicts, metrics) of one rollout, through the data transport as the training loop gets it."""
    import ray

    from vime.config.rollout import DataBufferConfig
    from vime.transport.rollouts import make_transport

    rollout = ray.get(manager.generate.remote(rollout_id), timeout=600)
    groups, extra = make_transport(DataBufferConfig.of(args)).get(rollout.handle)
    return groups, extra["metrics"]


def _check_groups(groups: list[list[dict]], n_groups: int, versions: list[int] | None = None) -> None:
    assert len(groups) == n_groups and all(len(g) == 4 for g in groups)
    assert len({g[0]["group_index"] for g in groups}) == n_groups
    for g in groups:
        for s in g:
            assert s["status"] in ("completed", "truncated"), s["metadata"]
            assert s["response_length"] > 0 and len(s["rollout_log_probs"]) == s["response_length"]
            if versions is not None:
                assert s["weight_versions"] == versions, s["weight_versions"]


@pytest.fixture(scope="module")
def stack(tiny_qwen3, arithmetic_data, tmp_path_factory):
    import ray

    from tests.helpers.run_sections import init_ray_of, placement_of
    from vime.driver.placement import shutdown_ray
    from vime.rollout_manager.manager import RolloutManager
    from vime.arguments import parse_args

    assert not stack_pids(), "engine or router processes are already running"
    out = tmp_path_factory.mktemp("fault_tolerance")
    token_file = out / "control_token"
    token_file.write_text(TOKEN.control)
    token_file.chmod(0o600)
    args = parse_args([
        "--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--debug-rollout-only",
        "--rollout-batch-size", "64", "--n-samples-per-prompt", "4", "--rollout-num-gpus", "2",
        "--rollout-max-response-len", "32", "--rollout-concurrency", str(CONCURRENCY), "--num-rollout", "3",
        "--use-fault-tolerance", "--rollout-health-check-interval", str(HEALTH_INTERVAL),
        "--rollout-health-check-timeout", str(HEALTH_TIMEOUT), "--update-weight-dir", str(out),
        "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--vllm-max-model-len", "256", "--vllm-max-num-seqs", "32", "--control-token-file", str(token_file),
    ])
    init_ray_of(args)
    manager = RolloutManager.remote(args, placement_of(args, with_trainers=False))
    try:
        ray.get(manager.start.remote())
        yield args, manager, out
    finally:
        ray.get(manager.shutdown.remote(), timeout=180)
        shutdown_ray()  # and the run's Ray token with it, from this process's environment too
        deadline = time.monotonic() + 30
        while stack_pids() and time.monotonic() < deadline:
            time.sleep(1)
        assert not stack_pids(), f"processes left: {stack_pids()}"


def test_256_requests_in_flight_through_the_router(stack):
    import ray

    args, manager, _ = stack
    urls = ray.get(manager.get_engine_urls.remote())
    peak, stop = [0.0], threading.Event()

    def watch():  # what the engines themselves hold, polled while the rollout runs
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], sum(_in_engine(u) for u in urls))
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        groups, metrics = _rollout(manager, args, 0)
    finally:
        stop.set()
        watcher.join()
    print(f"256 in flight: rollout {time.monotonic() - start:.1f}s, client peak {metrics['rollout/max_in_flight']}, "
          f"engines' peak {peak[0]}, retries {metrics['rollout/request_retries']}")
    _check_groups(groups, 64)
    assert metrics["rollout/num_samples"] == 256 and metrics["rollout/failed_samples"] == 0
    assert metrics["rollout/max_in_flight"] >= CONCURRENCY and metrics["rollout/request_retries"] == 0
    # more than the engines run at once (2 x --vllm-max-num-seqs 32) sat in them: requests queue, none is lost
    assert peak[0] > 2 * 32, f"the engines never queued requests (peak {peak[0]})"


def _node_addresses() -> list[str]:
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


CONTROL_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("POST", "/sleep"), ("POST", "/wake_up"),
                  ("POST", "/collective_rpc"), ("POST", "/vime/update_weights"), ("POST", "/abort_requests"),
                  ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"), ("POST", "/start_profile"),
                  ("POST", "/v1/load_lora_adapter"), ("GET", "/is_paused"), ("GET", "/metrics"),
                  ("GET", "/server_info")]


def test_control_routes_answer_only_to_the_run_token(stack, tiny_qwen3):
    import ray

    args, manager, out = stack
    urls = ray.get(manager.get_engine_urls.remote())
    router_url = ray.get(manager.get_router_url.remote())
    assert router_url.startswith("http://127.0.0.1:"), router_url  # admin routes on this node's loopback only
    port = int(router_url.rsplit(":", 1)[1])
    for address in _node_addresses():  # not on any other address of this node
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=5).close()
    wrong = {"Authorization": "Bearer " + "0" * 64}
    for url in urls:
        for method, route in CONTROL_ROUTES:
            seen = [http_status(url + route, method, h) for h in (None, wrong, TOKEN.serving_headers())]
            assert seen == [401, 401, 401], (url, route, seen)
        assert http_status(url + "/health") == 200
        assert http_status(url + "/is_paused", headers=TOKEN.control_headers()) == 200
        generate = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 2}, "model": "policy"}
        assert http_status(url + "/inference/v1/generate", "POST", None, generate) == 401
        assert http_status(url + "/inference/v1/generate", "POST", TOKEN.serving_headers(), generate) == 200
        # a weight load from outside the run's weight root (--update-weight-dir) is refused, token or not
        load = {"method": "vime_load_weights", "kwargs": {"path": str(tiny_qwen3)}}
        assert http_status(url + "/collective_rpc", "POST", TOKEN.control_headers(), load) >= 400
    # through the router, which sends its own (serving) key with every control call it forwards: refused
    for route in ("/pause", "/sleep", "/collective_rpc", "/vime/update_weights"):
        for headers in (None, TOKEN.control_headers()):
            assert http_status(router_url + route, "POST", headers, {"method": "vime_load_weights"}) != 200, route
    # the router's own routes, its admin ones included, open to the serving key only (`router_door`)
    admin = [("POST", "/add_worker?url=http://127.0.0.1:1"), ("POST", f"/remove_worker?url={urls[0]}"),
             ("POST", "/flush_cache"), ("GET", "/workers"), ("GET", "/list_workers"), ("GET", "/health"),
             ("GET", "/get_server_info"), ("POST", "/inference/v1/generate")]
    generate = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 2}, "model": "policy"}
    for method, route in admin:
        seen = [http_status(router_url + route, method, h, generate)
                for h in (None, wrong, TOKEN.control_headers())]
        assert seen == [401, 401, 401], (route, seen)
    assert http_status(router_url + "/health", headers=TOKEN.serving_headers()) == 200
    assert _router_workers(router_url) == sorted(urls)  # nothing above changed the router
    for url in urls:  # nothing above changed an engine
        state = json.loads(urllib.request.urlopen(urllib.request.Request(url + "/is_paused",
                                                                         headers=TOKEN.control_headers())).read())
        assert state["is_paused"] is False, (url, state)


def _perturbed_weights(model_dir: Path, out: Path) -> Path:
    """The tiny model's weights plus noise, as an HF directory: what a trainer's disk update would write."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_dir = out / "weights_v1"
    weights_dir.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for f in model_dir.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            tensors[name] = (t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)).contiguous()
    save_file(tensors, str(weights_dir / "model-pp0.safetensors"))  # the name the disk transport writes
    return weights_dir


def test_sigkilled_engine_is_replaced_with_the_current_weights(stack, tiny_qwen3):
    import ray

    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.disk.driver import DiskDriver

    args, manager, out = stack
    weights = _perturbed_weights(tiny_qwen3, out)
    ray.get(manager.apply_weights.remote(DiskDriver(DriverSetup.of(args)), str(weights), 1, str(weights)))
    probe = list(range(100, 140))
    before = ray.get(manager.probe_log_probs.remote(probe))
    assert max(abs(a - b) for a, b in zip(*before)) < 1e-5

    old_urls = ray.get(manager.get_engine_urls.remote())
    router_url = ray.get(manager.get_router_url.remote())
    victim = _server_pid(ray.get(manager.engine_pids.remote())[0])
    rollout = manager.generate.remote(1)  # runs while this test kills an engine
    deadline = time.monotonic() + 120
    while _in_engine(old_urls[0]) < 8:  # in the middle of the rollout: the victim is busy
        assert time.monotonic() < deadline, "the rollout never reached engine 0"
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()

    from vime.config.rollout import DataBufferConfig
    from vime.transport.rollouts import make_transport

    groups, extra = make_transport(DataBufferConfig.of(args)).get(ray.get(rollout, timeout=600).handle)
    metrics = extra["metrics"]
    print(f"rollout with a SIGKILL: done {time.monotonic() - killed:.1f}s after the kill, "
          f"{metrics['rollout/request_retries']} requests retried")
    _check_groups(groups, 64, versions=[1])
    assert metrics["rollout/failed_samples"] == 0

    window = HEALTH_INTERVAL + HEALTH_TIMEOUT + args.engine_startup_timeout
    while ray.get(manager.engine_restarts.remote()) < 1:
        assert time.monotonic() - killed < window, "the engine was not restarted within the health-check window"
        time.sleep(1)
    print(f"engine back {time.monotonic() - killed:.1f}s after the SIGKILL")
    urls = ray.get(manager.get_engine_urls.remote())
    new_url = next(u for u in urls if u not in old_urls)
    assert len(urls) == 2 and old_urls[1] in urls
    assert _router_workers(router_url) == sorted(urls)
    with urllib.request.urlopen(new_url + "/health", timeout=5) as r:
        assert r.status == 200
    # the new engine serves version 1 and exactly the weights the other engine serves
    after = ray.get(manager.probe_log_probs.remote(probe))
    assert max(abs(a - b) for a, b in zip(*after)) < 1e-5 and max(abs(a - b) for a, b in zip(after[0], before[0])) < 1e-5
    body = json.dumps({"token_ids": probe, "sampling_params": {"max_tokens": 2}, "model": "policy"}).encode()
    req = urllib.request.Request(new_url + "/inference/v1/generate", data=body,
                                 headers={"Content-Type": "application/json", **TOKEN.serving_headers()})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    assert [str(v["version"]) if isinstance(v, dict) else str(v) for v in answer["choices"][0]["weight_versions"]] \
        == ["1"], answer["choices"][0]

    groups, metrics = _rollout(manager, args, 2)
    _check_groups(groups, 64, versions=[1])
    assert metrics["rollout/engine_restarts"] == 1.0
    assert (Path(weights) / "model-pp0.safetensors").exists()  # a user's directory is never deleted
    shutil.rmtree(weights)


def _router_processes() -> list:
    """The stack's router: vime's router process and every process under it (the server renames itself)."""
    import psutil

    found = [p for p in psutil.process_iter(["cmdline"])
             if "vime.engine.control.router" in " ".join(p.info["cmdline"] or [])]
    assert found, "no router process found"
    return list({p.pid: p for q in found for p in [q, *q.children(recursive=True)]}.values())


def test_sigkilled_router_fails_the_rollout_which_is_not_trained_and_is_restarted(stack):
    import ray

    from vime.driver.session import TrainingSession

    args, manager, _ = stack
    urls = ray.get(manager.get_engine_urls.remote())
    old_router = ray.get(manager.get_router_url.remote())
    router = _router_processes()
    rollout = manager.generate.remote(3)
    deadline = time.monotonic() + 120
    while not any(_in_engine(u) for u in urls):  # as soon as it reaches the engines: most samples are still to come
        assert time.monotonic() < deadline, "the rollout never reached the engines"
        time.sleep(0.01)
    for proc in router:  # the whole router dies at once, as in a crash or an OOM kill
        proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    ref = ray.get(rollout, timeout=600)
    metrics = ref.extra["metrics"]
    print(f"rollout with a SIGKILLed router: done {time.monotonic() - killed:.1f}s after the kill, "
          f"failed ratio {metrics['rollout/failed_ratio']:.2f}")
    assert metrics["rollout/failed_ratio"] > args.max_failed_samples_ratio
    assert metrics["rollout/failed_ratio"] == metrics["rollout/failed_samples"] / metrics["rollout/num_samples"]
    assert "--max-failed-samples-ratio 0.5" in ref.extra["skip_reason"], ref.extra.get("skip_reason")
    # the training loop's path: no training step on it (a trained one would need trainers, which this run lacks)
    assert TrainingSession(args).train(ref) == {"train/skipped_rollout": 1.0}

    while ray.get(manager.router_restarts.remote()) < 1:
        assert time.monotonic() - killed < 60, "the router was not restarted within a minute of its death"
        time.sleep(0.5)
    print(f"router back {time.monotonic() - killed:.1f}s after the SIGKILL")
    new_router = ray.get(manager.get_router_url.remote())
    assert new_router != old_router and new_router.startswith("http://127.0.0.1:")
    assert http_status(new_router + "/health", headers=TOKEN.serving_headers()) == 200
    assert http_status(new_router + "/add_worker?url=http://127.0.0.1:1", "POST") == 401
    assert _router_workers(new_router) == sorted(ray.get(manager.get_engine_urls.remote())) == sorted(urls)

    groups, metrics = _rollout(manager, args, 4)
    _check_groups(groups, 64)
    assert metrics["rollout/failed_samples"] == 0 and metrics["rollout/router_restarts"] == 1.0
