"""What an engine's MTP drafter computes, compared between a drafter updated through vime's worker extension and one
loaded fresh by vLLM: run as `python draft_digest.py FAMILY OLD NEW UPDATE_DIR [FAMILY OLD NEW UPDATE_DIR ...]`
(UPDATE_DIR under $VIME_WEIGHT_ROOT holds NEW's tensors as the disk transport writes them); prints one JSON line,
{family: result}, after all (one process: vLLM is imported once).

In this process, one at a time: a vLLM engine of NEW drafting with its MTP layer gives the reference; an engine of
OLD loads UPDATE_DIR with `vime_load_weights` (the call every file transport makes; the broadcast and CUDA IPC ones
load through the same `_vime_load`). A digest is, per parameter of the policy and of the drafter, its sum, and per
linear layer whose dense weight vLLM's CPU kernels keep only in a packed form, the sum of what it computes on a
fixed input. Printed: {"dtype": the engines', "loaded": the worker's answer, "before"/"after"/"reference":
digests}."""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: collective_rpc takes a function


def digest(worker) -> dict[str, float]:
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    runner = worker.model_runner
    out = {}
    for tag, model in (("policy", runner.get_model()), ("draft", runner.get_draft_model())):
        for name, param in model.named_parameters():
            if param.numel():
                out[f"{tag}:{name}"] = float(param.detach().double().sum())
        for name, layer in model.named_modules():
            if isinstance(layer, LinearBase) and any(p.numel() == 0 for p in layer.parameters(recurse=False)):
                width = getattr(layer, "input_size_per_partition", layer.input_size)
                x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(worker.model_config.dtype)
                out[f"{tag}:{name}(x)"] = float(layer.quant_method.apply(layer, x).double().sum())
    return out


def engine(path: str, mla: bool, dtype: str):
    from vllm import LLM

    backend = {"attention_backend": "CPU_MLA"} if mla else {}  # float32 MLA on CPU (engine.engine_command's)
    return LLM(path, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0, **backend,
               speculative_config={"method": "mtp", "num_speculative_tokens": 1, **backend},
               worker_extension_cls="vime.engine.in_vllm.worker_extension.WeightReceiver")


def compare(family: str, old: str, new: str, update_dir: str) -> dict:
    mla = family == "deepseek_v3"
    # vLLM's CPU Gated DeltaNet: bfloat16 only
    dtype = "bfloat16" if family in ("qwen3_next", "qwen3_5_moe") else "float32"
    llm = engine(new, mla, dtype)
    reference = llm.collective_rpc(digest)[0]
    del llm
    gc.collect()
    llm = engine(old, mla, dtype)
    before = llm.collective_rpc(digest)[0]
    loaded = llm.collective_rpc("vime_load_weights", kwargs={"path": update_dir})[0]
    after = llm.collective_rpc(digest)[0]
    del llm
    gc.collect()
    return {"dtype": dtype, "loaded": loaded, "before": before, "after": after, "reference": reference}


if __name__ == "__main__":
    runs = sys.argv[1:]
    print(json.dumps({runs[i]: compare(*runs[i:i + 4]) for i in range(0, len(runs), 4)}))
