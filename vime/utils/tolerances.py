"""Every numeric tolerance vime's checks use, in one place, chosen by device and dtype.

    tolerance("logprob", "bfloat16", "cuda")  # -> 5e-2

Kinds (all absolute, except "logprob_relative"):
- "logprob": max |difference| of per-token log-probs between two computations of the same model and weights
  (trainer vs engine, packed vs unpacked, Megatron vs transformers).
- "logprob_relative": allowed on top of "logprob", per unit of the log-prob's own size (|log-prob|).
- "loss": a scalar loss (or a per-batch metric derived from log-probs) computed two ways.
- "grad": gradients computed two ways (max |difference| over elements).

Why the values differ by device, for float32 (the 16-bit rows are dominated by their own rounding on any device):
- CPU: both stacks (Megatron-core, vLLM-CPU, transformers) run IEEE float32 with comparable reductions; measured
  agreement is ~1e-6 on tiny models, 1.14e-5 on unlikely tokens (log-probs near -15) after 16 rollouts.
- CUDA: vime does not touch TF32 (no allow_tf32 / set_float32_matmul_precision in vime). torch's cuBLAS matmuls
  default to IEEE float32 there (allow_tf32 False; vLLM's workers set VLLM_FLOAT32_MATMUL_PRECISION, default
  "highest"), but two kernels vime runs on GPU use TF32 (10-bit mantissa inputs, float32 accumulation) for float32
  whatever torch says: TransformerEngine's GEMMs (vime's Megatron layers when TE is installed) ask cuBLASLt for
  CUBLAS_COMPUTE_32F_FAST_TF32, and vLLM's float32 attention on CUDA is Triton's (TRITON_ATTN; flash-attention has
  no float32), whose tl.dot rounds float32 inputs to TF32 by default. PyTorch's CUDA notes (TF32 section) measure
  a 10240^2 matmul at 2.2e-3 max relative error in TF32 vs 3.9e-5 in IEEE float32; on logits of size ~10 that is
  ~2e-2. So CUDA float32 gets TF32-sized values, a good deal below the 16-bit ones (activations stay float32).
  Comparisons that run neither kernel (Megatron's local layers without TE, transformers) agree far closer there.
"""

from __future__ import annotations

KINDS = ("logprob", "logprob_relative", "loss", "grad")
DTYPES = ("float32", "float16", "bfloat16")  # finest first
DEVICES = ("cpu", "cuda")

# The relative part models float32 rounding that grows with a log-prob's size: the final log_softmax is float32 in
# every stack whatever the weights' dtype, so it is the same in every row; where the absolute part is TF32- or
# 16-bit-sized it is sized for log-probs near the weight check's probe (-15) and dominates.
_RELATIVE = 1e-6

# 16-bit rows hold on any device (the CPU trainer is float32, but vLLM-CPU engines can serve in 16-bit with
# --vllm-dtype). logprob 5e-2: the weight check's 16-bit tolerance since it exists (kernels differ by more than a
# small training step moves a log-prob, so only gross errors are caught). float16 (eps 9.8e-4) keeps 3 more
# mantissa bits than bfloat16 (eps 3.9e-3) and could be held tighter, but no float16 run has measured it: it keeps
# bfloat16's log-prob value. loss / grad: a few eps of each (a mean over tokens averages the per-token rounding).
_FP16 = {"logprob": 5e-2, "logprob_relative": _RELATIVE, "loss": 5e-3, "grad": 5e-3}
_BF16 = {"logprob": 5e-2, "logprob_relative": _RELATIVE, "loss": 1e-2, "grad": 1e-2}

_TABLE: dict[tuple[str, str], dict[str, float]] = {
    # CPU float32: today's values. logprob 1e-5 + 1e-6 x |lp| covers the 1.14e-5 seen at lp ~ -15 (weight check);
    # a scalar loss averages many tokens, and grads were measured equal to 1e-6 (packed vs padded, TP/SP vs not).
    ("cpu", "float32"): {"logprob": 1e-5, "logprob_relative": _RELATIVE, "loss": 1e-6, "grad": 1e-6},
    # CUDA float32: TF32 inside TE's GEMMs and vLLM's Triton attention (module docstring): ~2e-3 relative per
    # matmul, ~2e-2 on log-probs from logits of size ~10; a mean loss and grads of size <~ 0.5 move ~1e-3.
    ("cuda", "float32"): {"logprob": 2e-2, "logprob_relative": _RELATIVE, "loss": 1e-3, "grad": 1e-3},
    ("cpu", "float16"): _FP16, ("cuda", "float16"): _FP16,
    ("cpu", "bfloat16"): _BF16, ("cuda", "bfloat16"): _BF16,
}


def dtype_name(dtype) -> str:
    """"float32" / "float16" / "bfloat16" for a torch.dtype or one of those names; ValueError otherwise."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: tolerances are known for {', '.join(DTYPES)}")
    return name


def device_type(device=None) -> str:
    """"cpu" / "cuda" for a torch.device or its string ("cuda:1" counts as "cuda"); None: "cuda" when CUDA is
    available in this process, else "cpu". ValueError for any other device type."""
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"unknown device {device!r}: tolerances are known for {', '.join(DEVICES)}")
    return kind


def tolerance(kind: str, dtype, device=None) -> float:
    """The tolerance of a check of `kind` (one of KINDS, see the module docstring) between two computations in
    `dtype` (a torch.dtype or its name: "float32", "bfloat16", "float16") on `device` (a torch.device, "cpu",
    "cuda"; None: "cuda" if torch.cuda.is_available() else "cpu"). Never smaller for a coarser dtype on the same
    device, nor on CUDA than on CPU. ValueError naming the choices for an unknown kind, dtype or device."""
    if kind not in KINDS:
        raise ValueError(f"unknown tolerance kind {kind!r}: one of {', '.join(KINDS)}")
    return _TABLE[(device_type(device), dtype_name(dtype))][kind]


def coarsest_dtype(*dtypes) -> str:
    """Of the given dtypes (torch.dtype or names), the one with the largest tolerances: what a comparison of
    computations in different dtypes (an engine in bfloat16, a trainer in float32) must allow."""
    return max((dtype_name(d) for d in dtypes), key=DTYPES.index)
