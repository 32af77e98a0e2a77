"""Megatron-core on 2 CPU processes (gloo): TP=2 and PP=2 forward passes equal one process; convert tools.

Each multi-process test spawns 2 workers that rendezvous on a free local port, load a tiny HF checkpoint,
and run Megatron's forward-only schedule (`get_forward_backward_func`) on micro-batches of different
lengths. The last stage writes its logits and per-token log-probs (from Megatron's vocab-parallel cross
entropy); the test compares them with the same schedule run in this process with TP=PP=1. The workers then
save the model as HF (TP gather, one file per stage), which must equal the original bit for bit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, to_device_of  # noqa: E402
from tests.helpers.trainer_runs import skip_without_a_gpu_per_rank  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MICRO_BATCH_LENGTHS = (16, 11)  # two micro-batches, 2 sequences each, different lengths


def _micro_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (2, n), generator=g) for n in MICRO_BATCH_LENGTHS]


def _build(hf_dir: str, tp: int, pp: int) -> list[torch.nn.Module]:
    """This rank's model chunks with the HF weights loaded. Needs `init_parallel(tp, pp)`."""
    from transformers import AutoConfig

    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
    from vime.trainer.megatron.model_provider import build_model_chunks

    args = add_megatron_args(argparse.ArgumentParser()).parse_args(
        ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
    args = fill_architecture_from_hf(args, AutoConfig.from_pretrained(hf_dir))
    model = build_model_chunks(args)
    load_hf_checkpoint_into_model(model, hf_dir)
    return [chunk.eval() for chunk in model]


def _forward(model: list[torch.nn.Module]) -> list[dict] | None:
    """Forward-only schedule over the micro-batches; on the last stage a dict per micro-batch with the full
    logits [b, s, vocab] and next-token log-probs [b, s-1]; None elsewhere."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from vime.trainer.megatron.hf_checkpoint import gather_tp_shards

    def forward_step(data_iterator, chunk):
        tokens = to_device_of(chunk, next(data_iterator))  # the model is on CUDA where there is one
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        output = chunk(tokens, positions, attention_mask=None)

        def loss_func(logits):  # last stage only; logits are vocab-parallel [b, s, vocab / TP]
            logprobs = -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), tokens[:, 1:])
            full = torch.cat(gather_tp_shards(logits), dim=-1)
            return torch.zeros((), device=logits.device), {"logits": full.cpu(), "logprobs": logprobs.cpu()}

        return output, loss_func

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(_micro_batches()), model=model,
            num_microbatches=len(MICRO_BATCH_LENGTHS), seq_length=max(MICRO_BATCH_LENGTHS), micro_batch_size=2,
            forward_only=True)
    return results if parallel_state.is_pipeline_last_stage() else None


def _worker(rank: int, world_size: int, port: int, tp: int, pp: int, hf_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    from vime.trainer.megatron.hf_checkpoint import save_hf_checkpoint

    init_parallel(tp, pp, seed=1234)
    try:
        model = _build(hf_dir, tp, pp)
        results = _forward(model)
        if results is not None:
            torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        save_hf_checkpoint(model, hf_dir, Path(out_dir) / "hf")  # gathers TP shards, one file per stage
    finally:
        destroy_parallel()


def _spawn(tp: int, pp: int, hf_dir: Path, out_dir: Path, timeout_s: float = 120.0) -> None:
    from tests.helpers import warm_start
    from vime.utils.misc import find_free_port

    nprocs = tp * pp
    skip_without_a_gpu_per_rank(nprocs)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    port, env = find_free_port(), {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    logs = [Path(out_dir) / f"rank{rank}.log" for rank in range(nprocs)]
    procs = [warm_start.start(_worker, (rank, nprocs, port, tp, pp, str(hf_dir), str(out_dir)), log, env, REPO)
             for rank, log in enumerate(logs)]
    try:
        failed = warm_start.wait_for_all(procs, timeout_s)
    except TimeoutError:
        pytest.fail(f"TP={tp} PP={pp} workers did not finish within {timeout_s} s")
    if failed is not None:
        pytest.fail(f"TP={tp} PP={pp} rank {failed} exited with {procs[failed].exitcode}:\n"
                    f"{logs[failed].read_text()[-6000:]}")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=3)


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama-tied", arch="llama", seed=5,
                            tie_word_embeddings=True)


def _single_process_reference(hf_dir: Path) -> list[dict]:
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    try:
        return _forward(_build(str(hf_dir), 1, 1))
    finally:
        destroy_parallel()


def _assert_same_hf_weights(original_dir: Path, saved_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original = load_file(original_dir / "model.safetensors")
    saved = AutoModelForCausalLM.from_pretrained(saved_dir, dtype=torch.float32).state_dict()  # reads shards
    if "lm_head.weight" not in original:  # tied: transformers exposes the embedding under both names
        saved.pop("lm_head.weight")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)


def _assert_close_to(reference: list[dict], got: list[dict]) -> None:
    """Both computed in float32 by models built where vime builds them (CUDA when available)."""
    bound = output_tolerance("logprob")
    assert len(got) == len(reference) == len(MICRO_BATCH_LENGTHS)
    for ref, out, length in zip(reference, got, MICRO_BATCH_LENGTHS):
        assert out["logits"].shape == ref["logits"].shape == (2, length, 512)
        assert (out["logits"] - ref["logits"]).abs().max().item() < bound
        assert (out["logprobs"] - ref["logprobs"]).abs().max().item() < bound


@pytest.mark.parametrize("tp, pp, last_rank", [(2, 1, 0), (1, 2, 1)], ids=["tp2", "pp2"])
def test_two_processes_match_one(tp, pp, last_rank, tiny_qwen2, tmp_path):
    reference = _single_process_reference(tiny_qwen2)
    # Sanity: the log-probs are those of the logits.
    logits = reference[0]["logits"][:, :-1].log_softmax(-1)
    expected = logits.gather(-1, _micro_batches()[0][:, 1:, None])[..., 0]
    assert (reference[0]["logprobs"] - expected).abs().max().item() < output_tolerance("logprob")
    _spawn(tp, pp, tiny_qwen2, tmp_path)
    _assert_close_to(reference, torch.load(tmp_path / f"rank{last_rank}.pt"))
    _assert_same_hf_weights(tiny_qwen2, tmp_path / "hf")


def test_pipeline_with_tied_embeddings(tiny_llama_tied, tmp_path):
    """The last stage keeps its own copy of the tied embedding as the output layer."""
    reference = _single_process_reference(tiny_llama_tied)
    _spawn(1, 2, tiny_llama_tied, tmp_path)
    _assert_close_to(reference, torch.load(tmp_path / "rank1.pt"))
    _assert_same_hf_weights(tiny_llama_tied, tmp_path / "hf")


def test_convert_tools_round_trip(tiny_qwen2, tmp_path):
    from safetensors.torch import load_file

    from tests.helpers import warm_start

    def run(tool, *argv):  # the script's command line, in a process forked with Megatron imported
        log = tmp_path / f"{tool}.log"
        status = warm_start.run_script(REPO / "scripts" / tool, list(map(str, argv)), log,
                                       {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, REPO, 180)
        assert status == 0, log.read_text()[-3000:]

    run("convert_hf_to_torch_dist.py", "--hf-checkpoint", tiny_qwen2, "--save", tmp_path / "torch_dist")
    assert (tmp_path / "torch_dist" / "latest_checkpointed_iteration.txt").read_text() == "release"
    run("convert_torch_dist_to_hf.py", "--load", tmp_path / "torch_dist", "--hf-checkpoint", tiny_qwen2,
        "--save", tmp_path / "hf")
    original, back = load_file(tiny_qwen2 / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tiny_qwen2 / name).read_bytes()


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "deepseek_v3", arch="deepseek_v3", seed=9)


def test_multi_latent_attention_and_moe_over_tensor_parallel(tiny_deepseek_v3, tmp_path):
    """DeepSeek-V3: the MLA down projections are column-parallel with a gathered output, the up projections and
    the shared expert split like dense layers, the router's expert bias is a replicated buffer; two TP ranks give
    the one-process logits and save the checkpoint back bit for bit (expert bias included)."""
    from safetensors.torch import load_file

    reference = _single_process_reference(tiny_deepseek_v3)
    _spawn(2, 1, tiny_deepseek_v3, tmp_path)
    _assert_close_to(reference, torch.load(tmp_path / "rank0.pt"))
    original, saved = (load_file(d / "model.safetensors") for d in (tiny_deepseek_v3, tmp_path / "hf"))
    assert saved.keys() == original.keys() and "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    assert all(torch.equal(saved[k], original[k]) for k in original)


@pytest.mark.parametrize("arch", ["qwen3_next", "glm4_moe"])
def test_hybrid_and_glm_layers_over_tensor_parallel(arch, tmp_path):
    """Qwen3-Next: each TP rank holds its share of the Gated DeltaNet key and value heads (in_proj's q, k, v, z, b,
    a blocks, the convolution's channels, A_log and dt_bias split block by block) and of the gated attention's
    query/gate heads; the shared expert's gate is replicated. GLM-4.5: qkv biases and partial rotary split like
    Qwen2's. Two TP ranks give the one-process logits and save the checkpoint back bit for bit."""
    from safetensors.torch import load_file

    from vime.synthetic.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / arch, arch=arch, seed=9)
    reference = _single_process_reference(model)
    _spawn(2, 1, model, tmp_path)
    _assert_close_to(reference, torch.load(tmp_path / "rank0.pt"))
    original, saved = (load_file(d / "model.safetensors") for d in (model, tmp_path / "hf"))  # experts one by one
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
