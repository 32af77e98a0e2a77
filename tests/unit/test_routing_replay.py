"""MoE routing replay: routed experts from the engine's answer into samples, through the codec and JSON, into
per-micro-batch replay tensors; the CPU engine's capture store; the flags' errors; and on a real tiny Qwen3-MoE
(and DeepSeek-V3) trainer (one CPU process): replaying its own routing changes nothing, replaying another routing
reproduces the log-probs computed under that routing, packed and padded alike."""

from __future__ import annotations

import base64
import copy
import gc
import io
import json
import weakref

import numpy as np
import pytest
import torch

from vime.data.sample import Sample
from vime.data.sample_codec import SampleCodecError, decode_rollout, encode_rollout, json_ready
from vime.engine.control.generate_request import decode_routed_experts
from vime.engine.in_vllm.routing_capture import RoutingStore, StepCapture
from vime.trainer.batching import micro_batch_inputs
from vime.trainer.routing_replay import micro_batch_routing, sample_routing


def _npy_b64(array: np.ndarray) -> str:  # what vLLM's servers write (vllm.utils.serial_utils.numpy2base64)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _routing(num_tokens: int, layers: int = 2, topk: int = 2, experts: int = 4, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(experts, topk, replace=False) for _ in range(layers)])
                     for _ in range(num_tokens)]).astype(np.uint8)


# ---- engine answer -> sample -> codec / JSON -------------------------------------------------------------------

def test_engine_answer_decodes_and_replaces_the_samples_routing():
    from vime.rollout.generation import append_choice

    class Tok:
        def decode(self, tokens, skip_special_tokens=False):
            return " ".join(map(str, tokens))

    sample = Sample(index=0, tokens=[5, 6, 7])
    first = _routing(4)  # 3 prompt tokens + 2 new, the last never forwarded
    append_choice(sample, {"token_ids": [8, 9], "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
                           "routed_experts": _npy_b64(first), "finish_reason": "length"}, Tok())
    assert sample.rollout_routed_experts.dtype == np.uint8 and np.array_equal(sample.rollout_routed_experts, first)
    again = _routing(5, seed=1)  # a continuation's answer routes the whole prompt again: it replaces
    append_choice(sample, {"token_ids": [10], "logprobs": {"content": [{"logprob": -1.0}]},
                           "routed_experts": _npy_b64(again)}, Tok())
    assert np.array_equal(sample.rollout_routed_experts, again) and len(sample.tokens) == 6


@pytest.mark.parametrize("bad, match", [("not base64!", "base64"), (_npy_b64(np.zeros((3, 2))), "integer"),
                                        (_npy_b64(np.array([b"x"], dtype=object).astype(str)), "integer")])
def test_bad_routed_experts_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        decode_routed_experts(bad)


def test_codec_round_trip_packs_routed_experts_compactly():
    small, wide = _routing(300), _routing(10).astype(np.uint16)
    wide[0, 0, 0] = 299  # a model of 300 experts
    groups = [[Sample(index=0, tokens=list(range(301)), response_length=5, rollout_routed_experts=small).to_dict(),
               Sample(index=1, tokens=[1, 2]).to_dict()],
              [Sample(index=2, tokens=list(range(11)), rollout_routed_experts=wide).to_dict()]]
    data = encode_rollout(groups, {"rollout_id": 1})
    back, extra = decode_rollout(data)
    assert extra == {"rollout_id": 1} and b"pickle" not in data
    got = [s["rollout_routed_experts"] for g in back for s in g]
    assert np.array_equal(got[0], small) and got[1] is None and np.array_equal(got[2], wide)
    assert got[0].dtype == got[2].dtype == np.uint16  # the narrowest width that holds the rollout's ids
    assert len(data) < (small.size + wide.size) * 2 + 3000  # not JSON text
    only_small = encode_rollout(groups[:1])
    assert decode_rollout(only_small)[0][0][0]["rollout_routed_experts"].dtype == np.uint8
    assert len(only_small) < small.size + 3000  # one byte an expert id
    without = encode_rollout([[Sample(index=0, tokens=[1]).to_dict()]])
    assert int.from_bytes(without[8:10], "little") == int.from_bytes(data[8:10], "little") == 3  # one format


def test_codec_refuses_non_integer_routing_and_damaged_shapes():
    with pytest.raises(SampleCodecError, match="integers"):
        encode_rollout([[Sample(index=0, rollout_routed_experts=np.zeros((2, 1, 1))).to_dict()]])
    data = encode_rollout([[Sample(index=0, tokens=[1, 2, 3], rollout_routed_experts=_routing(2)).to_dict()]])
    with pytest.raises(SampleCodecError):
        decode_rollout(data[:-1])


def test_json_dump_of_a_sample_with_routing_loads_back_for_the_trainer(tmp_path):
    from vime.rollout.debug_data import load_rollout, save_rollout

    routing = _routing(6)
    save_rollout(str(tmp_path / "r_{rollout_id}.jsonl"), 0,
                 [[Sample(group_index=0, index=0, tokens=list(range(7)), response_length=2,
                          rollout_routed_experts=routing)]])
    sample = load_rollout(str(tmp_path / "r_{rollout_id}.jsonl"), 0)[0][0]
    assert np.array_equal(np.asarray(sample.rollout_routed_experts), routing)
    assert json.loads(json.dumps(json_ready(sample.to_dict())))["rollout_routed_experts"] == routing.tolist()
    back, _ = decode_rollout(encode_rollout([[sample.to_dict()]]))  # nested lists pack like an array
    assert np.array_equal(back[0][0]["rollout_routed_experts"], routing)


# ---- replay tensors ----------------------------------------------------------------------------------------------

def test_sample_routing_pads_the_unforwarded_tail_and_checks_shapes():
    routing = _routing(4)
    full = sample_routing(routing, 5, num_layers=2, topk=2, index=3, num_experts=4)
    assert full.shape == (5, 2, 2) and full.dtype == torch.uint8  # kept compact; cast per micro-batch
    assert torch.equal(full[:4], torch.as_tensor(routing)) and full[4].tolist() == [[0, 1], [0, 1]]
    assert torch.equal(sample_routing(routing.tolist(), 4, 2, 2, 0).long(), torch.as_tensor(routing).long())
    with pytest.raises(ValueError, match="routes to expert 3, but the model has 3"):
        sample_routing(routing, 5, num_layers=2, topk=2, index=3, num_experts=3)
    with pytest.raises(ValueError, match="sample 3 carries no routed experts"):
        sample_routing(None, 5, 2, 2, 3)
    with pytest.raises(ValueError, match=r"shape \(4, 2, 2\), expected \[<= 5, 3, 2\]"):
        sample_routing(routing, 5, num_layers=3, topk=2, index=3)
    with pytest.raises(ValueError, match="expected"):
        sample_routing(routing, 3, num_layers=2, topk=2, index=0)  # more rows than tokens


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batch_routing_follows_the_models_token_order(packed):
    """Each token's routing row encodes its own token id: the assembled rows must line up with the token order
    the model sees (packed: one row of sequences; padded: [seq, batch] flattened seq-major)."""
    lengths = [3, 6, 1, 4]
    token_lists = [[100 * (k + 1) + j for j in range(n)] for k, n in enumerate(lengths)]
    per_sample = [torch.tensor([[[t, -t], [t + 1, -t - 1], [t + 2, -t - 2]] for t in toks]) for toks in token_lists]
    layers = [1, 2]
    out = micro_batch_routing(per_sample, layers, packed)
    inputs = micro_batch_inputs(token_lists, [1] * len(lengths), packed=packed)
    model_order = inputs.tokens.reshape(-1) if packed else inputs.tokens.t().reshape(-1)  # embedding: [s, b]
    real = model_order != 0
    for layer, rows in zip(layers, out):
        assert rows.shape == (len(model_order), 2)
        assert torch.equal(rows[real, 0], model_order[real] + layer) and torch.equal(rows[real, 1], -rows[real, 0])
        assert (rows[~real] == torch.tensor([0, 1])).all()  # padding: experts 0..k-1


# ---- the CPU engine's capture ------------------------------------------------------------------------------------

def test_capture_cuts_steps_per_request_and_the_store_places_them_by_position():
    capture, store = StepCapture(num_layers=3, topk=2, num_experts=8), RoutingStore()

    def step(req_ids, starts, positions):  # worker: one forward; scheduler: its output
        for req_id, (first, rows) in capture.by_request(req_ids, np.array(starts), np.array(positions)).items():
            store.add(req_id, first, rows)

    # prefill: request a (3 tokens at positions 0-2) and b (2 tokens); layer 0 is dense (never captured)
    capture.capture(1, torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0], [1, 3]]))
    capture.capture(2, torch.tensor([[2, 1], [4, 3], [6, 5], [0, 7], [3, 1], [0, 0]]))  # a padded row past the end
    step(["a", "b"], [0, 3, 5], [0, 1, 2, 0, 1])
    # a decode step: b at position 2, then a at position 3
    capture.capture(1, torch.tensor([[2, 4], [6, 7]]))
    capture.capture(2, torch.tensor([[4, 2], [7, 6]]))
    step(["b", "a"], [0, 1, 2], [2, 3])
    store.finish("a")
    store.finish("gone")  # a request that never ran a forward
    a = store.take("a")
    assert a.dtype == np.uint8 and a.shape == (4, 3, 2)
    assert a[:, 1].tolist() == [[1, 2], [3, 4], [5, 6], [6, 7]] and a[:, 2].tolist() == [[2, 1], [4, 3], [6, 5], [7, 6]]
    assert (a[:, 0] == 0).all() and store.take("a") is None and capture.by_request(["a"], np.array([0, 1]),
                                                                                   np.array([4])) == {}
    store.finish("b")
    assert store.take("b")[:, 1].tolist() == [[7, 0], [1, 3], [2, 4]]
    assert StepCapture(1, 1, num_experts=300).dtype == np.uint16  # vLLM's own choice of width


# ---- flags ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", seed=3)


BASE = ["--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl", "--rm-type", "math",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_replay_flags_on_a_dense_model_are_a_parse_time_error(flag, tiny_qwen3, capsys):
    from vime.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tiny_qwen3), *BASE, flag])
    assert f"{flag}: {tiny_qwen3} is a dense model" in capsys.readouterr().err


def test_rollout_replay_on_cpu_needs_one_worker_engines(tiny_moe):
    """Refused where the cluster's devices say CPU (the session, once Ray is up), not by the driver's own devices: a
    CPU-only head node may drive GPU engines."""
    from vime.arguments import parse_args, validate_transport_placement

    args = parse_args(["--hf-checkpoint", str(tiny_moe), *BASE, "--use-rollout-routing-replay",
                       "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"])
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine 1"):
        validate_transport_placement(args, gpus=False)
    validate_transport_placement(args, gpus=True)  # GPU engines capture routing across their workers
    validate_transport_placement(args, gpus=None)  # while parsing: the devices are not known yet


def test_engines_are_started_to_return_routing(tiny_moe):
    from vime.arguments import parse_args
    from vime.engine.control.engine import engine_command, engine_env
    from vime.engine.protocol.names import CAPTURE_ENV

    args = parse_args(["--hf-checkpoint", str(tiny_moe), *BASE, "--use-rollout-routing-replay"])
    cmd = engine_command(args, "127.0.0.1", 1234, 0)
    assert "--no-enable-prefix-caching" in cmd  # cached prompt tokens would not be routed
    assert engine_env(args, "token")[CAPTURE_ENV] == "1"
    plain = parse_args(["--hf-checkpoint", str(tiny_moe), *BASE])
    assert "--no-enable-prefix-caching" not in engine_command(plain, "127.0.0.1", 1234, 0)
    assert CAPTURE_ENV not in engine_env(plain, "token")


def test_a_sample_without_routing_is_named():
    from vime.rollout.vllm_rollout import check_routed_experts

    ok = Sample(index=0, tokens=[1, 2, 3], response_length=1, status=Sample.Status.COMPLETED,
                rollout_routed_experts=_routing(2))
    failed = Sample(index=1, tokens=[1, 2], response_length=1, status=Sample.Status.FAILED)
    check_routed_experts([[ok, failed]])
    with pytest.raises(RuntimeError, match="no routed experts for sample 2.*--enable-return-routed-experts"):
        check_routed_experts([[ok, Sample(index=2, tokens=[1, 2], response_length=1)]])


# ---- a real trainer --------------------------------------------------------------------------------------------

def _own_routing(t, groups) -> list[torch.Tensor]:
    """The trainer's own routing of every sample ([tokens, layers, top-k]), recorded in one forward."""
    from vime.trainer.passes import forward_log_probs
    from vime.trainer.routing_replay import RoutingReplay
    from vime.trainer.train_batch import TrainBatch

    batch = TrainBatch.from_samples(groups, t.args)
    routing = RoutingReplay(t.model, t.args.num_layers, len(batch.tokens))
    with routing.recording():
        forward_log_probs(t.args, t.model, batch, [[i] for i in range(len(batch.tokens))], routing=routing)
    return routing.routing


def _log_probs(t, groups, routing=None) -> list[torch.Tensor]:
    from vime.trainer.passes import forward_log_probs
    from vime.trainer.routing_replay import RoutingReplay
    from vime.trainer.train_batch import TrainBatch

    batch = TrainBatch.from_samples(groups, t.args)
    mbs = [list(range(i, min(i + 3, len(batch.tokens)))) for i in range(0, len(batch.tokens), 3)]  # of 3 samples
    replay = None
    if routing is not None:
        replay = RoutingReplay(t.model, t.args.num_layers, len(batch.tokens))
        replay.routing = list(routing)
        with replay.replaying():
            out = forward_log_probs(t.args, t.model, batch, mbs, routing=replay)
    else:
        out = forward_log_probs(t.args, t.model, batch, mbs)
    return [out[i][0] for i in range(len(batch.tokens))]


@pytest.mark.parametrize("arch, qkv_format", [("qwen3_moe", "thd"), ("qwen3_moe", "bshd"),
                                              ("deepseek_v3", "thd")])  # sigmoid, expert bias, expert groups
def test_trainer_replays_a_given_routing(arch, qkv_format, tiny_moe, tmp_path):
    from tests.helpers.devices import output_tolerance
    from tests.helpers.rollouts import flat, make_rollout
    from tests.helpers.trainer_runs import local_trainer
    from vime.synthetic.tiny_model import build_tiny_model

    model = tiny_moe if arch == "qwen3_moe" else build_tiny_model(tmp_path / arch, arch=arch, seed=3)
    groups = make_rollout(seed=5)
    with local_trainer(model, "--use-rollout-routing-replay", "--qkv-format", qkv_format) as t:
        experts, topk = t.args.num_experts, t.args.moe_router_topk
        own = _own_routing(t, groups)
        assert own[0].shape == (len(flat(groups)[0]["tokens"]), t.args.num_layers, topk)
        assert (own[0][:, 0] == torch.arange(topk)).all()  # layer 0 is dense: never routed, left at 0..k-1
        plain = _log_probs(t, groups)
        same = _log_probs(t, groups, own)
        # its own routing: no change (the replay path may round apart on a GPU)
        assert max((a - b).abs().max().item() for a, b in zip(plain, same)) < output_tolerance("logprob", cpu=1e-6)
        other = [(r + 1) % experts for r in own]  # every token to other experts
        moved = _log_probs(t, groups, other)
        assert min((a - b).abs().max().item() for a, b in zip(plain, moved)) > 1e-4

        # An "engine" that routed like `other`: its log-probs are what the trainer computes under that routing. The
        # rollout carries that routing (less the last token, never forwarded) and those log-probs; replaying it,
        # the trainer's first step sees no gap.
        rollout = copy.deepcopy(groups)
        for s, r, lp in zip(flat(rollout), other, moved):
            s["rollout_routed_experts"] = r[:-1].numpy().astype(np.uint8)
            s["rollout_log_probs"] = lp.tolist()
        metrics = t.train(0, rollout)
        assert metrics["train_rollout_logprob_abs_diff_max"] < output_tolerance("logprob"), metrics


def test_trainer_without_replay_sees_the_engines_other_routing_as_a_gap(tiny_moe):
    from tests.helpers.rollouts import flat, make_rollout
    from tests.helpers.trainer_runs import local_trainer

    groups = make_rollout(seed=5)
    with local_trainer(tiny_moe, "--use-rollout-routing-replay") as t:
        other = [(r + 1) % 4 for r in _own_routing(t, groups)]
        moved = _log_probs(t, groups, other)
    rollout = copy.deepcopy(groups)
    for s, lp in zip(flat(rollout), moved):
        s["rollout_log_probs"] = lp.tolist()
    with local_trainer(tiny_moe) as t:
        assert t.train(0, rollout)["train_rollout_logprob_abs_diff"] > 1e-3


def test_own_routing_replay_records_the_first_pass_and_replays_it(tiny_moe, monkeypatch):
    from tests.helpers.rollouts import make_rollout
    from tests.helpers.trainer_runs import local_trainer
    from vime.trainer import routing_replay

    modes, original = [], routing_replay.RoutingReplay.micro_batch

    def micro_batch(self, indices, lengths, packed):
        modes.append((self.mode, all(self.routing[i] is not None for i in indices)))
        return original(self, indices, lengths, packed)

    monkeypatch.setattr(routing_replay.RoutingReplay, "micro_batch", micro_batch)
    groups = make_rollout(seed=5)
    # two optimizer steps per rollout (so the old log-prob forward runs): 16 samples, micro-batches of 2
    with local_trainer(tiny_moe, "--use-routing-replay", "--global-batch-size", "8") as t:
        metrics = t.train(0, groups)
        assert metrics["train/steps"] == 2 and metrics["train/grad_norm"] > 0
        assert modes == [("record", False)] * 8 + [("replay", True)] * 8
        assert all(s.replay.router_replay_action is None and s.replay.target_topk_idx is None
                   for s in routing_replay.model_routers(t.model))
        modes.clear()
        t.train(1, make_rollout(seed=6, num_prompts=2))  # one step: nothing to replay, nothing recorded
        assert modes == []
    # torn down and unreferenced, the trained model is collected, and with it its gloo groups' threads and sockets
    # (the gradient hooks Megatron's DDP puts on C++ autograd nodes must not hold it)
    model = weakref.ref(t.model[0])
    del t
    gc.collect()
    assert model() is None


def test_capture_state_lives_on_the_model_runner_and_the_scheduler():
    """No module-level capture: each model runner makes its own (bound once to its model), each scheduler its own
    store of routed experts."""
    from types import SimpleNamespace

    from vime.engine.in_vllm.routing_capture import _capture_for, _store_of

    config = SimpleNamespace(get_total_num_hidden_layers=lambda: 3, get_num_experts_per_tok=lambda: 2,
                             get_num_experts=lambda: 8)

    def runner():
        model = SimpleNamespace(vime_routing_bound=True)  # bound already: vLLM's binder is not called here
        return SimpleNamespace(vllm_config=SimpleNamespace(model_config=config), get_model=lambda: model)

    one = runner()
    capture = _capture_for(one)
    assert _capture_for(one) is capture and (capture.num_layers, capture.topk) == (3, 2)
    assert _capture_for(runner()) is not capture
    a, b = SimpleNamespace(), SimpleNamespace()
    assert _store_of(a) is _store_of(a) and _store_of(b) is not _store_of(a)
