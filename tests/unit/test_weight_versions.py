"""Per-token weight versions (vime/data/weight_versions.py): spans kept over a sample's response tokens as the
engine reports them, through the default rollout and the agent endpoint's trajectories, and the staleness metrics
train_async reports, against hand counts."""

from __future__ import annotations

import json

import pytest

from vime.data.weight_versions import add_spans, add_versions, shift_spans, staleness_metrics, \
    trained_tokens_by_version
from vime.data.sample import Sample


def test_spans_merge_across_answers_and_place_each_answer_at_its_offset():
    spans, distinct = [], []
    # answer 1: 5 tokens, the update to version 2 landed after its third
    first = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}]
    add_spans(spans, first, 0, 5)
    add_versions(distinct, first)
    # answer 2 (a partial rollout continued, or the next turn): 4 tokens at offset 7, all version 2
    add_spans(spans, [{"version": "2", "start": 0, "end": 4}], 7, 4)
    add_versions(distinct, ["2"])
    assert spans == [[1, 0, 3], [2, 3, 5], [2, 7, 11]]  # not contiguous: 5-7 are tool tokens
    assert distinct == [1, 2]
    add_spans(spans, [{"version": "2", "start": 0, "end": 2}], 11, 2)  # contiguous, same version: merged
    assert spans[-1] == [2, 7, 13]
    add_spans(spans, ["3"], 13, 2)  # an engine that reports labels only: the whole answer is the last one's
    assert spans[-1] == [3, 13, 15]
    add_spans(spans, None, 15, 3)  # no versions reported: nothing claimed
    assert len(spans) == 4
    assert shift_spans([["1", 0, 4], ["2", 4, 9]], 6) == [["2", 0, 3]]  # the prompt's part cut away


def test_trained_tokens_by_version_and_staleness_by_hand():
    a = Sample(tokens=list(range(10)), response_length=6, loss_mask=[1, 1, 1, 0, 1, 1],
               weight_versions=["3", "4"], weight_version_spans=[["3", 0, 3], ["4", 3, 6]]).to_dict()
    b = Sample(tokens=list(range(6)), response_length=4, weight_versions=["4"]).to_dict()  # labels only
    c = Sample(tokens=[1, 2], response_length=1).to_dict()  # no versions (a replayed or synthetic sample)
    counts = [trained_tokens_by_version(s) for s in (a, b, c)]
    assert counts == [[[3, 3], [4, 2]], [[4, 4]], []]
    m = staleness_metrics(counts, trainer_version=5)
    # per sample the oldest token's lag: a 5 - 3 = 2, b 1; per token: 3 tokens at lag 2, 6 at lag 1
    assert m["async/staleness_mean"] == pytest.approx(1.5) and m["async/staleness_max"] == 2.0
    assert m["async/token_staleness_mean"] == pytest.approx((3 * 2 + 6 * 1) / 9)
    assert m["async/token_lag_1_fraction"] == pytest.approx(6 / 9)
    assert m["async/token_lag_2_fraction"] == pytest.approx(3 / 9)
    assert m["async/mixed_version_samples"] == 1.0
    assert staleness_metrics([[], []], 5) == {}  # no versions: no metric rather than a wrong one
    assert staleness_metrics(json.loads(json.dumps(counts)), 5) == m  # ints still, over the transport's JSON
    with pytest.raises(ValueError, match="'latest' is not one vime sets"):  # a label no vime engine reports
        trained_tokens_by_version({"response_length": 1, "weight_versions": ["latest"]})


def test_a_sample_keeps_the_engines_spans_through_the_default_rollout_and_the_codec():
    from vime.data.sample_codec import decode_rollout, encode_rollout
    from vime.rollout.generation import append_choice

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    sample = Sample(tokens=[1, 2, 3], response_length=0)
    choice = {"token_ids": [7, 8, 9, 10], "logprobs": {"content": [{"logprob": -0.1}] * 4}, "finish_reason": "abort",
              "weight_versions": [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 4}]}
    append_choice(sample, choice, Tok())
    resumed = {"token_ids": [11, 12], "logprobs": {"content": [{"logprob": -0.2}] * 2}, "finish_reason": "stop",
               "weight_versions": [{"version": "2", "start": 0, "end": 2}]}
    append_choice(sample, resumed, Tok())  # a partial rollout continued under version 2
    assert sample.weight_version_spans == [[1, 0, 1], [2, 1, 6]] and sample.weight_versions == [1, 2]
    [[back]], _ = decode_rollout(encode_rollout([[sample.to_dict()]]))
    assert back["weight_version_spans"] == [[1, 0, 1], [2, 1, 6]]


def test_agent_trajectories_keep_spans_over_the_response():
    from vime.agents.chat_session import Trajectory, trajectory_to_sample

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return ""

    t = Trajectory()
    t.add_context([1, 2, 3])
    t.prompt_length = 3
    t.add_sampled([4, 5], [-0.1, -0.2], [{"version": "1", "start": 0, "end": 2}])
    t.add_context([6])  # a tool's answer
    t.add_sampled([7, 8, 9], [-0.1] * 3, [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1,
                                                                                    "end": 3}])
    sample = trajectory_to_sample(t, Sample(), Tok(), "main", "s")
    assert sample.weight_version_spans == [[1, 0, 2], [1, 3, 4], [2, 4, 6]]
    assert trained_tokens_by_version(sample.to_dict()) == [[1, 3], [2, 2]]


@pytest.mark.parametrize("spans", [[["1", 0, 9]], [["v1", 0, 1]], [[1.0, 0, 1]], [["1", 2, 1]], [["1", 0]], ["1"]])
def test_malformed_spans_are_refused_naming_the_field(spans):
    from vime.data.sample import InvalidSampleError, check_sample_dict

    with pytest.raises(InvalidSampleError, match="weight_version_spans"):
        check_sample_dict({"tokens": [1, 2, 3], "response_length": 2, "weight_version_spans": spans})


def test_the_staleness_bound_leaves_out_samples_with_a_token_older_than_k_versions():
    import argparse

    from vime.trainer.train_batch import TrainBatch
    from vime.data.weight_versions import oldest_version, too_stale

    def sample(index, spans=None, labels=None):
        return Sample(index=index, tokens=[1, 2, 3, 4], response_length=2, reward=1.0,
                      status=Sample.Status.COMPLETED, weight_versions=labels or [],
                      weight_version_spans=spans or []).to_dict()

    fresh = sample(0, [["5", 0, 2]])
    mixed = sample(1, [["2", 0, 1], ["5", 1, 2]])  # its first token is 6 - 2 = 4 versions old
    labels = sample(2, labels=["3", "4"])  # labels only: the oldest counts
    unknown = sample(3)
    assert [oldest_version(s) for s in (fresh, mixed, labels, unknown)] == [5, 2, 3, None]
    assert [too_stale(s, 6, 2) for s in (fresh, mixed, labels, unknown)] == [False, True, True, False]
    assert not too_stale(mixed, 6, None)  # no bound without the flag
    args = argparse.Namespace(max_staleness=3, reward_key=None, use_rollout_routing_replay=False, lora_adapters=None)
    batch = TrainBatch.from_samples([[fresh, mixed], [labels, unknown]], args, trainer_version=6)
    assert batch.stale == 1 and batch.num_usable == 3
    assert batch.loss_masks[1].sum() == 0 and batch.rewards[1] == 0.0  # left out, its place kept


def test_engine_idle_fraction_of_a_step():
    from vime.driver.entry_point import engine_idle_fraction

    assert engine_idle_fraction({"rollout/time": 1.5}, 2.0) == pytest.approx(0.25)  # generated 1.5 s of a 2 s step
    assert engine_idle_fraction({"rollout/time": 3.0}, 2.0) == 0.0  # generated beside longer than the step took
    assert engine_idle_fraction({"rollout/time": 1.5, "buffer/replayed": 1.0}, 2.0) == 1.0  # from storage
    assert engine_idle_fraction({}, 2.0) == 1.0 and engine_idle_fraction({"rollout/time": 1.0}, 0.0) == 0.0
