"""The engine flags of a slime launch script written for SGLang (`--sglang-*`), read before vime's parser: each
one with a vLLM equivalent becomes that flag (a one-line notice says so), and one without is refused before
anything starts, naming the flag to use instead.

    argv, notices = translate_sglang_flags(["--sglang-mem-fraction-static", "0.7", "--lr", "1e-6"])
    argv == ["--vllm-gpu-memory-utilization", "0.7", "--lr", "1e-6"]

`SGLANG_FLAGS` is the table (docs/guides/slime.md shows it): every `--sglang-*` flag slime's own scripts set.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SGLangFlagError(ValueError):
    """A --sglang-* flag with no vLLM equivalent vime can map; the message names what to use."""


@dataclass(frozen=True)
class SGLangFlag:
    takes: str  # "value" (one), "values" (one or more), "switch" (none)
    to: str | None = None  # the vLLM / vime flag it becomes; None: refused with `instead`
    why: str = ""  # the notice's reason, or (refused) what to use instead
    values: dict[str, str] = field(default_factory=dict)  # SGLang value -> vLLM value, where the names differ


_ATTENTION = {"fa3": "FLASH_ATTN", "fa4": "FLASH_ATTN", "flashinfer": "FLASHINFER", "triton": "TRITON_ATTN",
              "flashmla": "FLASHMLA", "torch_native": "TORCH_SDPA"}
_SPECULATIVE = ("use --vllm-speculative-config '{\"method\": \"eagle\" | \"eagle3\" | \"mtp\", "
                "\"model\": DRAFT, \"num_speculative_tokens\": K}' (vLLM drafts K tokens a step: SGLang's "
                "--sglang-speculative-num-steps)")
_ENGINE_LAYOUT = ("vime starts one engine per --rollout-num-gpus-per-engine GPUs and spreads requests over them; "
                  "inside an engine use --vllm-tensor-parallel-size, and --vllm-enable-expert-parallel for MoE")

SGLANG_FLAGS: dict[str, SGLangFlag] = {
    "--sglang-mem-fraction-static": SGLangFlag(
        "value", "--vllm-gpu-memory-utilization",
        "the share of each GPU's memory the engine takes (SGLang's counts weights and KV cache, vLLM's everything "
        "the engine allocates)"),
    "--sglang-cuda-graph-bs": SGLangFlag("values", "--vllm-cudagraph-capture-sizes",
                                         "the batch sizes captured as CUDA graphs"),
    "--sglang-cuda-graph-max-bs": SGLangFlag("value", "--vllm-max-cudagraph-capture-size",
                                             "the largest batch captured as a CUDA graph"),
    "--sglang-max-running-requests": SGLangFlag("value", "--vllm-max-num-seqs",
                                                "requests an engine runs at once"),
    "--sglang-chunked-prefill-size": SGLangFlag("value", "--vllm-max-num-batched-tokens",
                                                "tokens an engine step takes, prefill chunks included"),
    "--sglang-kv-cache-dtype": SGLangFlag("value", "--vllm-kv-cache-dtype", "the KV cache's element type"),
    "--sglang-page-size": SGLangFlag("value", "--vllm-block-size", "tokens per KV cache block"),
    "--sglang-reasoning-parser": SGLangFlag("value", "--vllm-reasoning-parser", "the reasoning parser"),
    "--sglang-disable-radix-cache": SGLangFlag("switch", "--no-vllm-enable-prefix-caching",
                                               "no prefix cache (SGLang's radix cache)"),
    "--sglang-attention-backend": SGLangFlag("value", "--vllm-attention-backend", "the attention kernels",
                                             values=_ATTENTION),
    "--sglang-ep-size": SGLangFlag(
        "value", None, "use --vllm-enable-expert-parallel: vLLM's expert-parallel size is the engine's tensor x "
        "data parallel size (--rollout-num-gpus-per-engine GPUs)"),
    "--sglang-expert-parallel-size": SGLangFlag("value", None, "use --vllm-enable-expert-parallel (see "
                                                "--sglang-ep-size)"),
    "--sglang-enable-deepep-moe": SGLangFlag("switch", None, "use --vllm-enable-expert-parallel with vLLM's "
                                             "--vllm-all2all-backend"),
    "--sglang-deepep-mode": SGLangFlag("value", None, "use --vllm-all2all-backend (vLLM's DeepEP kernels)"),
    "--sglang-moe-a2a-backend": SGLangFlag("value", None, "use --vllm-all2all-backend"),
    "--sglang-dp-size": SGLangFlag("value", None, _ENGINE_LAYOUT),
    "--sglang-enable-dp-attention": SGLangFlag("switch", None, _ENGINE_LAYOUT),
    "--sglang-enable-dp-lm-head": SGLangFlag("switch", None, _ENGINE_LAYOUT),
    "--sglang-moe-dense-tp-size": SGLangFlag("value", None, _ENGINE_LAYOUT),
    "--sglang-server-concurrency": SGLangFlag(
        "value", None, "use --rollout-concurrency: requests in flight over all engines together (SGLang's value "
        "times the number of engines)"),
    "--sglang-speculative-algorithm": SGLangFlag("value", None, _SPECULATIVE),
    "--sglang-speculative-num-steps": SGLangFlag("value", None, _SPECULATIVE),
    "--sglang-speculative-num-draft-tokens": SGLangFlag("value", None, _SPECULATIVE),
    "--sglang-speculative-eagle-topk": SGLangFlag("value", None, _SPECULATIVE),
    "--sglang-speculative-draft-attention-backend": SGLangFlag("value", None, _SPECULATIVE),
    "--sglang-enable-deterministic-inference": SGLangFlag(
        "switch", None, "vLLM's batch-invariant kernels are turned on by VLLM_BATCH_INVARIANT=1 in the engines' "
        "environment; --rollout-seed seeds the sampling"),
    "--sglang-tool-call-parser": SGLangFlag("value", None, "use --agent-tool-call-format: vime parses tool calls "
                                            "itself, from the tokens the engine sampled"),
    "--sglang-watchdog-timeout": SGLangFlag("value", None, "use --rollout-request-timeout (a request's limit) and "
                                            "the health monitor (--use-fault-tolerance)"),
    "--sglang-disable-overlap-schedule": SGLangFlag("switch", None, "vLLM has no overlap scheduler switch: drop it"),
}
_GENERIC = ("vime maps only the --sglang-* flags slime's scripts set (docs/guides/slime.md); vLLM's own engine flags "
            "are --vllm-<name> (train.py --help lists them)")


def _values(argv: list[str], i: int, takes: str) -> tuple[list[str], int]:
    """The values of the flag at argv[i] (with its `--flag=value` form), and the index after them."""
    flag = argv[i]
    if "=" in flag:
        return [flag.split("=", 1)[1]], i + 1
    j = i + 1
    if takes == "switch":
        return [], j
    while j < len(argv) and not argv[j].startswith("--") and (takes == "values" or j == i + 1):
        j += 1
    if j == i + 1:
        raise SGLangFlagError(f"{flag} needs a value")
    return argv[i + 1:j], j


def translate_sglang_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` with every --sglang-* flag replaced by its vLLM equivalent, and a notice per replacement; raises
    SGLangFlagError naming each flag that has none and what to use instead (all of them at once)."""
    out, notices, refused = [], [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if not name.startswith("--sglang-"):
            out.append(token)
            i += 1
            continue
        spec = SGLANG_FLAGS.get(name)
        values, i = _values(argv, i, spec.takes if spec else "values")
        if spec is None or spec.to is None:
            refused.append(f"{name}: {spec.why if spec else _GENERIC}")
            continue
        mapped = [spec.values.get(v, v) for v in values]
        unknown = [v for v in values if spec.values and v not in spec.values]
        if unknown:
            refused.append(f"{name} {' '.join(unknown)}: no vLLM equivalent vime knows for that value; pass "
                           f"{spec.to} with one of vLLM's (SGLang's {', '.join(spec.values)} map to "
                           f"{', '.join(sorted(set(spec.values.values())))})")
            continue
        out += [spec.to, *mapped]
        notices.append(f"{' '.join([name, *values])} -> {' '.join([spec.to, *mapped])} ({spec.why})")
    if refused:
        raise SGLangFlagError("SGLang engine flags vime cannot map to vLLM's:\n  " + "\n  ".join(refused))
    return out, notices
