"""An engine started outside vime (`--rollout-external-engine-addrs`): a plain `vllm` OpenAI server process, with
the run's control token in its environment as docs/guides/security.md says, started beside the run (which waits for
its /health), serves a real run of 2 rollouts: vime registers it
with its router, updates its weights after each rollout and checks them (--check-weight-update-equal), leaves it
running, and it then serves exactly the run's final weights; its control routes refuse a caller without the
token. The run is PPO: actor and critic ranks, the critic's values into GAE on the actor, its returns back to the
critic's update. The actor trains LoRA adapters (rank 4, all linears; the critic trains in full): the engine gets the
merged weights, the weight check holds after each update and --save-hf writes the merged model it serves."""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.e2e.processes import stack_pids
from tests.helpers.hf_reference import load_hf, response_log_probs
from tests.helpers.http_calls import http_status
from vime.rollout.debug_data import load_rollout
from vime.utils.misc import find_free_port
from vime.utils.process import kill_tree, wait_until

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_external_engine_is_registered_updated_and_verified(tiny_qwen3, arithmetic_data, tmp_path):
    assert not stack_pids()
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    port = find_free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_PLUGINS": "vime",
           "VIME_CONTROL_TOKEN": token_file.read_text(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_qwen3),
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "policy", "--enable-scale-out",
         "--logprobs-mode", "processed_logprobs", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
         "--no-enable-chunked-prefill", "--seed", "0"],
        env=env, stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # the run starts beside the server, as a job script would start them: it waits for the server's /health
        out = tmp_path / "out"
        cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
               "--prompt-data", str(arithmetic_data[0]), "--label-key", "label", "--apply-chat-template",
               "--rm-type", "random", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2",
               "--rollout-max-response-len", "16", "--micro-batch-size", "8", "--lr", "1e-2",
               "--advantage-estimator", "ppo", "--lora-rank", "4", "--lora-alpha", "32",
               "--rollout-external-engine-addrs", f"127.0.0.1:{port}", "--control-token-file", str(token_file),
               "--check-weight-update-equal", "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"),
               "--save-hf", str(out / "final_hf"), "--output-dir", str(out / "run")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert http_status(f"{url}/pause", "POST") in (401, 403)  # the token's middleware is in front of it

        records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if "train/steps" in r]
        assert [r["rollout_id"] for r in train] == [0, 1]
        for r in train:
            assert r["weight_check/max_abs_logprob_diff"] < 1e-5, r
            assert r["train_rollout_logprob_abs_diff"] < 1e-5, r  # the engine sampled from the trained policy
            assert r["critic/grad_norm"] > 0 and math.isfinite(r["critic/value_loss"]), r
            # GAE: returns = advantages + the critic's values, token means alike
            assert r["train/return_mean"] - r["train/advantage_mean"] == pytest.approx(r["critic/values_mean"],
                                                                                       abs=1e-4), r
        versions = {v for g in load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 1) for s in g
                    for v in s.weight_versions}
        assert versions == {1}  # rollout 1 ran on the weights vime pushed after rollout 0

        # left running, and serving the run's final weights (not the checkpoint it started from)
        assert server.poll() is None and http_status(f"{url}/health") == 200
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        body = json.dumps({"token_ids": prompt, "model": "policy", "sampling_params": {
            "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 0}}).encode()
        from vime.utils.auth import serving_key  # the key generation requests carry, made from the run's token

        request = urllib.request.Request(f"{url}/inference/v1/generate", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {serving_key(token_file.read_text())}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            choice = json.loads(response.read())["choices"][0]
        engine = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
        tokens = prompt + choice["token_ids"]
        final, start = (response_log_probs(load_hf(p), tokens, len(prompt)) for p in (out / "final_hf", tiny_qwen3))
        assert (final - engine).abs().max() < 1e-4
        assert (start - engine).abs().max() > 1e-3
        # LoRA: the projections moved, the embeddings and norms are the checkpoint's, bit for bit
        from safetensors.torch import load_file

        saved, base = (load_file(p / "model.safetensors") for p in (out / "final_hf", tiny_qwen3))
        assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"],
                               base["model.layers.0.self_attn.q_proj.weight"])
        assert all(torch.equal(saved[n], base[n]) for n in base if "proj" not in n)
    finally:  # stopped as its user would (SIGTERM): SIGKILLed, vLLM leaves its shared-memory queues in /dev/shm
        kill_tree(server, grace_s=30)
    assert wait_until(lambda: not stack_pids(), timeout_s=30), stack_pids()
