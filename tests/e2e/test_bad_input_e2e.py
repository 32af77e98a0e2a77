"""Bad input all the way through a real training run (train.py, 1 vLLM engine behind vllm-router, Megatron, Ray):
a prompt file with malformed rows, a prompt over --rollout-max-prompt-len, a prompt the engine rejects (longer than
--vllm-max-model-len) and a --custom-rm-path reward that raises on some samples, sleeps past
--rm-timeout on others, returns a string, NaN or inf on others, and hands others to vime's remote_rm against a
reward server that answers NaN and Infinity; one sample in eight is scored by remote_rm against a working reward
server (the success path: its score is the sample's reward). The run finishes; metrics.jsonl counts the skipped
rows, the over-long prompt and every failure by reason; the saved rollouts carry status failed with the reasons; no
NaN reaches a metric or a weight (the saved HF weights are finite and trained)."""

from __future__ import annotations

import http.server
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
RM_TIMEOUT, MAX_MODEL_LEN, MAX_RESPONSE_LEN, MAX_PROMPT_LEN = 1.0, 256, 16, 300

PLUGIN = textwrap.dedent('''
    import asyncio
    import os
    import time

    from vime.rollout.rm_hub.remote_rm import remote_rm
    from vime.utils.misc import with_values

    def reward(args, sample):
        """By sample index: 0 raises, 1 hangs past --rm-timeout, 2 returns a string, 3 NaN, 4 inf, 5 is scored by
        remote_rm against the test's reward server (NaN, Infinity), 6 by remote_rm against its working route, the
        rest are scored here."""
        kind = sample.index % 8
        if kind == 0:
            raise ValueError(f"cannot score sample {sample.index}")
        if kind == 1:
            time.sleep(4 * args.rm_timeout)
            return 1.0
        if kind == 2:
            return "not a number"
        if kind == 3:
            return float("nan")
        if kind == 5:
            return asyncio.run(remote_rm(with_values(args, rm_url=os.environ["BAD_RM_SERVER_URL"]), sample))
        if kind == 4:
            return float("inf")
        if kind == 6:
            return asyncio.run(remote_rm(with_values(args, rm_url=os.environ["GOOD_RM_SERVER_URL"]), sample))
        return float(len(sample.response) % 3 == 0)
''')

MALFORMED = ['{"prompt": "What is 1 + 1?", "label": "2"',  # not JSON
             '["What is 1 + 1?", "2"]',  # not an object
             '{"question": "What is 1 + 1?", "label": "2"}',  # no --input-key
             '{"prompt": [{"content": "What is 1 + 1?"}], "label": "2"}']  # a chat message without a role


def expected_failure(sample: dict, rejected_prompt: str) -> str | None:
    if rejected_prompt in sample["prompt"]:
        return "generate_engine_rejected"
    return {0: "reward_error", 1: "reward_timeout", 2: "reward_bad_return_type", 3: "reward_non_finite",
            4: "reward_non_finite", 5: "reward_non_finite"}.get(sample["index"] % 8)


def _long_prompt(tokenizer, low: int, high: int) -> str:
    """A prompt whose chat-templated length (as the prompt loader counts it) is in (low, high] tokens."""
    for n in range(1, 1000):
        text = "Add these: " + " ".join(["7"] * n)
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
        length = len(tokenizer(templated, add_special_tokens=False)["input_ids"])
        if length > low:
            assert length <= high, length
            return text
    raise AssertionError("no prompt length in the window")


def served_score(response: str) -> float:
    """What the working route scores a response (any number the trainer would not compute itself)."""
    return round(len(response) / 64 + 0.125, 6)


class _NonFiniteRewardServer(http.server.BaseHTTPRequestHandler):
    """A reward server: /score works (`served_score` of the response, as {"reward": x}); elsewhere it has gone
    wrong and its answers alternate between the JSON texts NaN and Infinity."""

    answered: list[str] = []
    scored: list[dict] = []

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/score":
            self.scored.append(request)
            body = json.dumps({"reward": served_score(request["response"])})
        else:
            body = ("NaN", "Infinity")[len(self.answered) % 2]
            self.answered.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def bad_run(tiny_qwen3, arithmetic_data, tmp_path_factory):
    from transformers import AutoTokenizer

    assert not stack_pids(), "engine or router processes are already running"
    out = tmp_path_factory.mktemp("bad_input")
    (out / "bad_rm_plugin.py").write_text(PLUGIN)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    rejected = _long_prompt(tokenizer, MAX_MODEL_LEN, MAX_PROMPT_LEN)  # passes the loader, not the engine
    too_long = rejected + " 7" * 40
    good = arithmetic_data[0].read_text().splitlines()[:12]
    lines = [good[0], MALFORMED[0], good[1], json.dumps({"prompt": rejected, "label": "0"}), MALFORMED[1],
             json.dumps({"prompt": too_long, "label": "0"}), good[2], MALFORMED[2], *good[3:8], MALFORMED[3],
             *good[8:]]
    data = out / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(data),
        "--label-key", "label", "--apply-chat-template", "--max-bad-prompt-rows-ratio", "0.3",
        "--rollout-max-prompt-len", str(MAX_PROMPT_LEN), "--custom-rm-path", "bad_rm_plugin.reward",
        "--rm-timeout", str(RM_TIMEOUT), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--num-rollout", "2", "--rollout-num-gpus", "1", "--rollout-max-response-len", str(MAX_RESPONSE_LEN),
        "--micro-batch-size", "8", "--lr", "1e-2", "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"),
        "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--max-failed-samples-ratio", "1.0",  # this run fails most samples on purpose
        "--vllm-max-model-len", str(MAX_MODEL_LEN), "--save-hf", str(out / "hf_{rollout_id}"),
    ]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NonFiniteRewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/reward"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(out), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "BAD_RM_SERVER_URL": url, "GOOD_RM_SERVER_URL": url.replace("/reward", "/score")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert {"NaN", "Infinity"} <= set(_NonFiniteRewardServer.answered)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return out, rejected, records, proc.stderr, stack_pids()


def test_the_run_trains_through_bad_input(bad_run):
    _, _, records, _, left = bad_run
    train = [r for r in records if "train/steps" in r]
    assert [r["rollout_id"] for r in train] == [0, 1] and all(r["train/steps"] >= 1 for r in train)
    assert not left, f"processes left after the run: {left}"


def test_malformed_and_too_long_rows_are_counted_once_and_named(bad_run):
    out, _, records, stderr, _ = bad_run
    assert records[0]["data/skipped_rows"] == len(MALFORMED) and records[0]["data/too_long_prompts"] == 1
    assert all("data/skipped_rows" not in r for r in records[1:])
    data = out / "prompts.jsonl"
    for line in (2, 5, 8, 14):  # the malformed rows' line numbers, each warned about with its reason
        assert f"{data}:{line}:" in stderr
    assert "not valid JSON" in stderr and "missing key 'prompt' (--input-key)" in stderr


def test_failures_are_recorded_per_sample_and_counted_by_reason(bad_run):
    out, rejected, records, _, _ = bad_run
    seen, remote_scored = {}, 0
    for rollout_id, record in zip((0, 1), records):
        groups = load_rollout(str(out / "rollout_{rollout_id}.jsonl"), rollout_id)
        assert len(groups) == 4 and all(len(g) == 4 for g in groups)
        counts = {}
        for s in (s.to_dict() for g in groups for s in g):
            reason = expected_failure(s, rejected)
            if reason is None:
                assert s["status"] in ("completed", "truncated") and isinstance(s["reward"], float), s
                if s["index"] % 8 == 6:  # remote_rm's success path: the server's score is the reward
                    assert s["reward"] == pytest.approx(served_score(s["response"])), s
                    assert any(r["response"] == s["response"] and r["label"] == s["label"]
                               for r in _NonFiniteRewardServer.scored), s
                    remote_scored = remote_scored + 1
                continue
            failure = s["metadata"]["failure"]
            assert s["status"] == "failed" and f"{failure['stage']}_{failure['reason']}" == reason, (reason, s)
            assert not any(s["loss_mask"] or []), "a failed sample is never trained"
            counts[reason] = counts.get(reason, 0) + 1
            seen.setdefault(reason, []).append(failure["error"])
        failed = {k.removeprefix("rollout/failed/"): v for k, v in record.items() if k.startswith("rollout/failed/")}
        assert failed == counts and record["rollout/failed_samples"] == sum(counts.values())
    assert remote_scored > 0 and len(_NonFiniteRewardServer.scored) >= remote_scored
    assert set(seen) == {"generate_engine_rejected", "reward_error", "reward_timeout", "reward_bad_return_type",
                         "reward_non_finite"}
    assert all("ValueError: cannot score sample" in e for e in seen["reward_error"])
    assert all(f"--rm-timeout {RM_TIMEOUT}" in e for e in seen["reward_timeout"])
    assert all("--custom-rm-path bad_rm_plugin.reward returned str ('not a number')" in e
               for e in seen["reward_bad_return_type"])
    assert all("HTTP 400" in e for e in seen["generate_engine_rejected"])
    non_finite = seen["reward_non_finite"]
    assert any("is not finite; the reward function must return a finite number" in e for e in non_finite)
    served = [e for e in non_finite if "reward server http://127.0.0.1:" in e]  # remote_rm's NaN and Infinity
    assert any("non-finite reward nan" in e for e in served) and any("non-finite reward inf" in e for e in served)


def test_non_finite_rewards_reach_no_metric_and_no_weight(bad_run, tiny_qwen3):
    """NaN rewards used to crash the rollout metrics (statistics.pstdev) or, past them, turn every advantage and
    then every weight NaN (no loss scaler skips a bf16 or fp32 step)."""
    from safetensors.torch import load_file

    out, _, records, _, _ = bad_run
    for record in records:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        assert record.get("train/skipped_steps", 0.0) == 0.0, record
    trained = {k: v for f in sorted((out / "hf_1").glob("*.safetensors")) for k, v in load_file(f).items()}
    start = {k: v for f in sorted(tiny_qwen3.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert trained and all(v.isfinite().all() for v in trained.values())
    assert any(not v.equal(start[k]) for k, v in trained.items() if k in start)  # the weights really moved
