"""vime.utils.tolerances: the values per device and dtype, their order, the errors, and the weight check's use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vime.transport.weights import check
from vime.utils.tolerances import DEVICES, DTYPES, KINDS, coarsest_dtype, tolerance

FINER_TO_COARSER = ("float32", "float16", "bfloat16")


def test_cpu_float32_keeps_the_values_the_checks_had():
    assert tolerance("logprob", "float32", "cpu") == 1e-5
    assert tolerance("logprob_relative", torch.float32, "cpu") == 1e-6
    assert tolerance("loss", "float32", torch.device("cpu")) == 1e-6
    assert tolerance("grad", "float32", "cpu") == 1e-6
    assert (check.FLOAT32_TOLERANCE, check.RELATIVE_TOLERANCE, check.HALF_TOLERANCE) == (1e-5, 1e-6, 5e-2)


def test_values_per_device_and_dtype():
    assert tolerance("logprob", "float32", "cuda") == 2e-2  # TF32 in TE's GEMMs and vLLM's Triton attention
    assert tolerance("loss", "float32", "cuda:1") == tolerance("grad", "float32", torch.device("cuda", 0)) == 1e-3
    for device in DEVICES:  # 16-bit: the weight check's 5e-2 on any device
        assert tolerance("logprob", "bfloat16", device) == tolerance("logprob", torch.float16, device) == 5e-2
        assert tolerance("loss", torch.bfloat16, device) == 1e-2 and tolerance("grad", "float16", device) == 5e-3
    assert all(tolerance("logprob_relative", d, dev) == 1e-6 for d in DTYPES for dev in DEVICES)


@pytest.mark.parametrize("kind", KINDS)
def test_coarser_dtype_and_gpu_never_tighter(kind):
    for device in DEVICES:
        values = [tolerance(kind, dtype, device) for dtype in FINER_TO_COARSER]
        assert values == sorted(values), (kind, device, values)
        assert all(v > 0 for v in values)
    for dtype in DTYPES:
        assert tolerance(kind, dtype, "cuda") >= tolerance(kind, dtype, "cpu"), (kind, dtype)


def test_default_device_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tolerance("logprob", "float32") == tolerance("logprob", "float32", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tolerance("logprob", "float32") == tolerance("logprob", "float32", "cuda")


@pytest.mark.parametrize("kind, dtype, device, names", [
    ("logits", "float32", "cpu", "logprob, logprob_relative, loss, grad"),
    ("loss", "float64", "cpu", "float32, float16, bfloat16"),
    ("loss", torch.int64, "cpu", "float32, float16, bfloat16"),
    ("grad", "float32", "mps", "cpu, cuda"),
])
def test_unknown_kind_dtype_or_device_names_the_choices(kind, dtype, device, names):
    with pytest.raises(ValueError, match=names):
        tolerance(kind, dtype, device)


def test_coarsest_dtype():
    assert coarsest_dtype("float32", torch.float32) == "float32"
    assert coarsest_dtype(torch.bfloat16, "float32") == coarsest_dtype("float16", "bfloat16") == "bfloat16"
    assert coarsest_dtype("float32", "float16") == "float16"


@pytest.mark.parametrize("trainer, flags, dtype", [
    (("float32", "cpu"), dict(bf16=True), "float32"),  # the CPU trainer computes in float32 whatever the flags
    (("float32", "cpu"), dict(vllm_dtype="bfloat16"), "bfloat16"),  # ... but an engine asked for bf16 does not
    (("float32", "cuda"), dict(), "float32"),
    (("bfloat16", "cuda"), dict(bf16=True), "bfloat16"),
    (("float16", "cuda"), dict(fp16=True), "float16"),
    (("float32", "cuda"), dict(vllm_dtype="half"), "float16"),  # engines in fp16, trainer in fp32: the coarser
])
def test_weight_check_tolerance_follows_what_the_trainer_computes_in(monkeypatch, trainer, flags, dtype):
    """The training ranks report their (dtype, device); the driver, here without a GPU (a CPU-only head node
    placing GPU trainers), does not decide it from its own devices. Before: "cuda" and the dtype came from the
    driver's `use_gpu()`, so such a driver checked GPU trainers at CPU float32's 1e-5."""
    import vime.utils.device

    monkeypatch.setattr(vime.utils.device, "use_gpu", lambda: False)
    args = SimpleNamespace(**{"bf16": False, "fp16": False, "vllm_dtype": None, **flags})
    device = trainer[1]
    assert check.check_dtype_and_device(args, trainer) == (dtype, device)
    assert check.tolerance_for(args, trainer) == tolerance("logprob", dtype, device)
    assert check.relative_tolerance_for(args, trainer) == tolerance("logprob_relative", dtype, device)


def test_compare_log_probs_takes_the_relative_part():
    lps = [-15.0, -1.0]
    assert check.compare_log_probs(lps, [[-15.0 + 2e-5, -1.0]], ["u"], 1e-5, relative=1e-6)[check.METRIC] \
        == pytest.approx(2e-5)
    with pytest.raises(check.WeightUpdateMismatchError, match=r"1e-05 \+ 1e-07 x \|log-prob\|"):
        check.compare_log_probs(lps, [[-15.0 + 2e-5, -1.0]], ["u"], 1e-5, relative=1e-7)
