"""`load_in_place` against vLLM's own `reload_weights` on a real (in-process) vLLM CPU model: same log-probs,
partial updates keep the other layers, a load that fails half way raises and can be redone, and the cases it does
not handle fall back untouched. Runs in a child process: an in-process vLLM engine needs
VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vime.engine.in_vllm import weight_loading

    model_dir = sys.argv[1]
    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=256, enable_chunked_prefill=False)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model, config = worker.model_runner.get_model(), worker.vllm_config
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def probe():
        out = llm.generate([{"prompt_token_ids": list(range(100, 140))}], params, use_tqdm=False)[0]
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    base_weights = load_file(f"{model_dir}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base_weights.items()}
    base = probe()
    worker.reload_weights(weights_iterator=iter(new_weights.items()), is_checkpoint_format=True)
    reference = probe()  # vLLM's own reload of the new weights
    worker.reload_weights(weights_iterator=iter(base_weights.items()), is_checkpoint_format=True)
    r = {"restored_by_vllm": gap(probe(), base)}

    r["in_place"] = weight_loading.load_in_place(config, model, iter(new_weights.items()))
    r["in_place_vs_vllm"] = gap(probe(), reference)
    norms = [(k, v) for k, v in base_weights.items() if "norm" in k]  # a partial update: norms only
    weight_loading.load_in_place(config, model, iter(norms))
    r["partial_vs_vllm"] = gap(probe(), reference)
    weight_loading.load_in_place(config, model, iter([(k, new_weights[k]) for k, _ in norms]))
    r["partial_back"] = gap(probe(), reference)

    def failing():
        yield from list(base_weights.items())[:5]
        raise RuntimeError("the sender went away")
    try:
        weight_loading.load_in_place(config, model, failing())
    except RuntimeError:
        r["failure_raised"] = True
    weight_loading.load_in_place(config, model, iter(new_weights.items()))  # the update, redone
    r["after_retry"] = gap(probe(), reference)

    weight_loading.IN_PLACE_MAX_BYTES = 0  # too large: untouched, for reload_weights
    untouched = iter(base_weights.items())
    r["too_large"] = weight_loading.load_in_place(config, model, untouched)
    r["left_in_iterator"] = len(list(untouched))
    r["n_weights"] = len(base_weights)
    print("RESULT " + json.dumps(r))
''')


def test_in_place_loading_matches_vllm_reload(tiny_qwen3, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(REPO)}
    (tmp_path / "check.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(tiny_qwen3)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["restored_by_vllm"] == 0.0
    assert r["in_place"] is True and r["in_place_vs_vllm"] <= 1e-6
    assert r["partial_vs_vllm"] > 1e-3 and r["partial_back"] <= 1e-6  # only the norms changed, and back
    assert r["failure_raised"] and r["after_retry"] <= 1e-6  # a failed load raises; doing it again repairs it
    assert r["too_large"] is False and r["left_in_iterator"] == r["n_weights"]


MOE_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vime.engine.in_vllm import weight_loading

    model_dir, perturbed_dir = sys.argv[1], sys.argv[2]
    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=256, enable_chunked_prefill=False)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = worker.model_runner.get_model()
    tokens = list(range(100, 140))

    def probe():
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    def reload(weights):
        with weight_loading.packing_cpu_experts(model) as n:
            worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return n

    hf = AutoModelForCausalLM.from_pretrained(perturbed_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)
    reference = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    base_weights, new_weights = load_file(f"{model_dir}/model.safetensors"), load_file(f"{perturbed_dir}/model.safetensors")
    base = probe()
    r = {"base_vs_hf_new": (base - reference).abs().max().item(), "moe_layers": reload(new_weights.items())}
    r["new_vs_hf"] = (probe() - reference).abs().max().item()
    # an update that does not reach the experts leaves their packed weights as they are
    reload([(k, v) for k, v in new_weights.items() if ".experts." not in k])
    r["partial_vs_hf"] = (probe() - reference).abs().max().item()
    reload(base_weights.items())
    r["back_to_base"] = (probe() - base).abs().max().item()
    print("RESULT " + json.dumps(r))
''')


def test_moe_reload_pads_and_packs_cpu_experts(tmp_path):
    """A Qwen3-MoE whose experts are narrower than the CPU kernel's alignment (80: vLLM pads them to 96) and
    whose MoE layers alternate with dense ones of another width (decoder_sparse_step 2): vLLM's reload alone
    fails to copy the unpadded experts into the padded storage; within `packing_cpu_experts` the engine then
    serves the new weights as transformers computes them, a partial update leaves the experts packed, and the
    old weights come back exactly."""
    import torch
    from safetensors.torch import load_file, save_file

    from vime.synthetic.tiny_model import build_tiny_model

    layout = {"moe_intermediate_size": 80, "mlp_only_layers": [], "decoder_sparse_step": 2}
    model = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=5, num_layers=3, config=layout)
    perturbed = build_tiny_model(tmp_path / "moe-new", arch="qwen3_moe", seed=5, num_layers=3, config=layout)
    g = torch.Generator().manual_seed(0)
    weights = load_file(perturbed / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              perturbed / "model.safetensors", metadata={"format": "pt"})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(REPO)}
    (tmp_path / "check.py").write_text(MOE_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(model), str(perturbed)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["moe_layers"] == 1  # layer 1 of 0, 1, 2
    assert r["base_vs_hf_new"] > 1e-2  # the update changes what the engine serves
    assert r["new_vs_hf"] <= 1e-5 and r["partial_vs_hf"] <= 1e-5
    assert r["back_to_base"] == 0.0

