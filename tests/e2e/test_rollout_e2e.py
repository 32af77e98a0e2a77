"""End to end on the real stack: 2 vLLM engines + vllm-router under Ray, `train.py --debug-rollout-only`."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.crash_hold_plugin import FUNCTION_PATH, held_run_env, wait_until_held
from tests.e2e.processes import stack_pids as _stack_pids
from tests.e2e.processes import vllm_process_names, worker_cpus
from vime.data.sample import Sample
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8


def _cmd(model: Path, data: Path, out: Path, num_rollout: int) -> list[str]:
    return [
        sys.executable, str(REPO / "train.py"),
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--debug-rollout-only",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", str(num_rollout),
        "--rollout-num-gpus", "2", "--rollout-max-response-len", "24", "--rollout-temperature", str(TEMPERATURE),
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"), "--output-dir", str(out / "run"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "512",
    ]


@pytest.fixture(scope="module")
def rollout_run(tiny_qwen3, arithmetic_data, tmp_path_factory):
    """One run, held before its third rollout: what it did in two rollouts and, while it serves, the CPUs its
    engines compute on; then Ctrl-C, and the stack's processes that are left after it."""
    assert not _stack_pids(), "engine or router processes are already running"
    # a directory others may pass through (pytest's own are 0700): the run's output directory must keep them out
    out = Path(tempfile.mkdtemp(prefix="vime-rollout-e2e-"))
    out.chmod(0o711)
    hold, log = out / "hold", out / "run.log"  # a file: a pipe nobody reads could fill and block the run
    token_file = out / "token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    cmd = _cmd(tiny_qwen3, arithmetic_data[0], out, 3) + ["--rollout-function-path", FUNCTION_PATH,
                                                           "--control-token-file", str(token_file)]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                env=held_run_env(hold, at=2))
    try:
        wait_until_held(proc, hold, lambda: log.read_text()[-6000:])
        workers = worker_cpus()
        for _ in range(20):  # a process name psutil could not read this once (busy, renaming) is read again
            if len(workers) == 2:
                break
            time.sleep(0.5)
            workers = worker_cpus()
        served = {"workers": workers, "seen": [] if len(workers) == 2 else vllm_process_names(),
                  "metrics": (out / "run" / "metrics.jsonl").read_text(),
                  "engine_logs": {p.name: p.read_text() for p in (out / "run" / "logs").glob("engine_*.log")},
                  "routes": _engine_routes(log.read_text(), token_file.read_text().strip()),
                  "hostile": _another_user_probes(log.read_text(), token_file.read_text().strip(),
                                                  str(out / "run"))
                  if os.getuid() == 0 and shutil.which("setpriv") else None}
        proc.send_signal(signal.SIGINT)
        hold.unlink()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while _stack_pids() and time.monotonic() < deadline:
        time.sleep(1)
    yield out, served, _stack_pids()
    shutil.rmtree(out, ignore_errors=True)


HOSTILE = textwrap.dedent('''
    import json, os, sys, urllib.error, urllib.request
    secrets_, urls = json.loads(sys.stdin.read())  # on stdin: a secret in this argv would be found by the scan
    def status(url, method="GET", data=None):
        try:
            headers = {"Content-Type": "application/json"} if data is not None else {}
            return urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                          timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return type(e).__name__
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        hits += [pid for secret in secrets_ if secret in cmdline]
    engines, router = urls["engines"], urls["router"]
    router_routes = [("POST", "/add_worker?url=http://127.0.0.1:1"), ("POST", "/remove_worker?url=" + engines[0]),
                     ("POST", "/flush_cache"), ("GET", "/workers"), ("GET", "/health"),
                     ("POST", "/inference/v1/generate")]
    generate = json.dumps({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "model": "policy"}).encode()
    ray_tokens = []
    for d in (d for d in os.listdir("/tmp") if d.startswith("vime-ray-auth-")):
        try:
            ray_tokens.append(open(f"/tmp/{d}/auth_token").read())
        except OSError as e:
            ray_tokens.append(type(e).__name__)
    outputs = []
    for path in (urls["output_dir"], urls["output_dir"] + "/config.yaml", urls["output_dir"] + "/metrics.jsonl"):
        try:
            outputs.append(len(os.listdir(path)) if path == urls["output_dir"] else len(open(path).read()))
        except OSError as e:
            outputs.append(type(e).__name__)
    print(json.dumps({"cmdline_hits": hits, "outputs": outputs,
                      "router": [status(router + r, m, generate if m == "POST" else None) for m, r in router_routes],
                      "ray_tokens": ray_tokens,
                      "engine_control": [status(u + r) for u in engines for r in ("/is_paused", "/server_info")]
                                        + [status(u + "/collective_rpc", "POST", b"{}") for u in engines],
                      "engine_generate": [status(u + "/inference/v1/generate", "POST", b"{}") for u in engines],
                      "plugin_front": status(urls["front"] + "/workers")}))
''')


def _another_user_probes(run_log: str, token: str, output_dir: str) -> dict:
    """What uid 65534 finds while the run serves: the run's token or serving key in any process's argv, and the
    answers of the engines' control and generation routes and of the router's front for plugins."""
    from vime.utils.auth import serving_key

    match = re.search(r"engines (\[.*?\]) behind router (\S+) \(custom functions: (\S+)\)", run_log)
    engines = json.loads(match.group(1).replace("'", '"'))
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I", "-c",
                           HOSTILE], input=json.dumps([[token, serving_key(token)],
                                                       {"engines": engines, "router": match.group(2),
                                                        "front": match.group(3), "output_dir": output_dir}]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _engine_routes(run_log: str, token: str) -> dict:
    """The real engine's routes (its OpenAPI listing, read with the control token) and what the serving key opens
    of them: {path: status of a request with the serving key}."""
    import urllib.error
    import urllib.request

    from vime.utils.auth import serving_key

    engine = json.loads(re.search(r"engines (\[.*?\])", run_log).group(1).replace("'", '"'))[0]
    listing = urllib.request.Request(engine + "/openapi.json", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(listing, timeout=30) as r:
        paths = sorted(json.loads(r.read())["paths"])
    opened = {}
    for path in paths:
        if "{" in path:
            continue
        probe = urllib.request.Request(engine + path, headers={"Authorization": f"Bearer {serving_key(token)}"},
                                       method="OPTIONS")  # no route runs: the middleware answers first or 405
        try:
            with urllib.request.urlopen(probe, timeout=30) as r:
                opened[path] = r.status
        except urllib.error.HTTPError as e:
            opened[path] = e.code
    return {"paths": paths, "with_serving_key": opened}


def test_the_serving_key_opens_only_the_listed_routes_of_the_real_engine(rollout_run):
    """Every route of the real vLLM server that the serving key gets past the middleware (anything but 401) is
    in route_auth's list of generation routes; the ones vime's rollouts use exist there."""
    from vime.engine.protocol.names import PUBLIC_PATHS, SERVING_PATHS

    _, served, _ = rollout_run
    routes = served["routes"]
    assert {"/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(routes["paths"])
    past = {p for p, status in routes["with_serving_key"].items() if status != 401}
    assert past <= SERVING_PATHS | PUBLIC_PATHS, past - SERVING_PATHS
    assert {"/collective_rpc", "/inference/v1/abort_requests", "/pause"} <= {
        p for p, status in routes["with_serving_key"].items() if status == 401}


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv for a 2nd uid")
def test_another_user_finds_no_secret_and_no_open_door(rollout_run):
    """Another user on the node, while the run serves: no process's argv holds the token or the serving key
    (the router's arguments once did); every engine route answers 401 without a key, and so does every route of
    the router, /add_worker and /remove_worker included; the router's front for plugins answers 403; the run's
    Ray token and its output directory (in a directory anyone may pass through) cannot be read."""
    _, served, _ = rollout_run
    hostile = served["hostile"]
    assert hostile["cmdline_hits"] == [], hostile
    assert set(hostile["engine_control"]) == {401} and set(hostile["engine_generate"]) == {401}, hostile
    assert hostile["router"] == [401] * 6, hostile
    assert hostile["plugin_front"] == 403
    assert hostile["ray_tokens"] and set(hostile["ray_tokens"]) == {"PermissionError"}, hostile
    assert hostile["outputs"] == ["PermissionError"] * 3, hostile  # the output directory is the run's alone


def test_every_sample_is_complete(rollout_run):
    out, _, _ = rollout_run
    for rollout_id in range(2):
        groups = load_rollout(str(out / "rollout_{rollout_id}.jsonl"), rollout_id)
        assert len(groups) == 8 and all(len(g) == 4 for g in groups)
        assert len({g[0].group_index for g in groups}) == 8
        for g in groups:
            for s in g:
                assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.metadata
                assert s.response_length > 0 and len(s.tokens) == s.prompt_length + s.response_length
                assert len(s.rollout_log_probs) == s.response_length == len(s.loss_mask)
                assert all(lp <= 0 for lp in s.rollout_log_probs)
                assert s.reward in (0.0, 1.0)
                assert s.weight_versions == [0]  # vLLM's "default": the checkpoint, version 0
                assert isinstance(s.response, str)
    # the two rollouts used different prompts (the data source advances)
    r0 = load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 0)
    r1 = load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 1)
    assert {g[0].prompt for g in r0}.isdisjoint({g[0].prompt for g in r1})


def test_saved_rollouts_load_back_equal(rollout_run):
    out, _, _ = rollout_run
    path = out / "rollout_0.jsonl"
    lines = path.read_text().splitlines()
    samples = [Sample.from_dict(json.loads(line)) for line in lines]
    assert [json.loads(json.dumps(s.to_dict())) for s in samples] == [json.loads(line) for line in lines]
    assert samples == [s for g in load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 0) for s in g]


def test_metrics_written(rollout_run):
    out, served, _ = rollout_run
    records = [json.loads(line) for line in served["metrics"].splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["rollout/num_samples"] == 32 for r in records)
    # TensorBoard holds every scalar of metrics.jsonl, at its rollout's step, with its value
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "run" / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    for r in records:
        for key, value in r.items():
            if key == "rollout_id":
                continue
            logged = {e.step: e.value for e in board.Scalars(key)}
            assert logged.get(r["rollout_id"]) == pytest.approx(value, rel=1e-6, abs=1e-6), (key, logged)
    assert len(board.Tags()["scalars"]) == len({k for r in records for k in r} - {"rollout_id"})


def test_each_group_is_one_request_to_the_engines(rollout_run):
    _, served, _ = rollout_run
    assert len(served["engine_logs"]) == 2
    requests = sum(text.count("POST /inference/v1/generate") for text in served["engine_logs"].values())
    assert requests == 2 * 8  # 2 rollouts x 8 groups of 4 samples: one request (n = 4) per group, not 64


def test_live_engines_compute_on_cpus_of_their_own(rollout_run):
    """While the run serves, the two engines compute on different CPUs (vLLM's own binding pinned both to one
    core)."""
    _, served, _ = rollout_run
    workers = served["workers"]
    assert len(workers) == 2 and not workers[0] & workers[1], (workers, served["seen"])


def test_ctrl_c_leaves_no_processes(rollout_run):
    """Ctrl-C while the run serves: every engine, engine core and router process is gone."""
    _, _, left = rollout_run
    assert not left, f"processes left after Ctrl-C: {left}"


def test_engine_log_probs_match_transformers(rollout_run, tiny_qwen3):
    """vLLM's processed log-probs of sampled tokens == log_softmax(logits / T) of a float32 HF forward."""
    from transformers import AutoModelForCausalLM

    out, _, _ = rollout_run
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    samples = [s for g in load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 0) for s in g][:12]
    worst = 0.0
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        targets = torch.tensor(s.tokens[s.prompt_length:])
        ref = logp[s.prompt_length - 1 : len(s.tokens) - 1].gather(-1, targets[:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(s.rollout_log_probs)).abs().max().item())
    assert worst < 1e-4, f"max |vLLM - transformers| log-prob = {worst}"
