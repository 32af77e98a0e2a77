"""pass@k (unbiased estimator), mean@k and maj@k against their closed forms and brute force
(vime/algorithms/eval_metrics.py)."""

import itertools
from math import comb

import pytest

from vime.algorithms.eval_metrics import eval_at_k_metrics, maj_at_k, mean_at_k, pass_at_k


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(6, 2, 3) == pytest.approx(1 - comb(4, 3) / comb(6, 3))  # 1 - 4/20 = 0.8
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


@pytest.mark.parametrize("correct", [[1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 0, 1, 1, 0], [0, 0, 0]])
def test_pass_at_k_equals_brute_force(correct):
    for k in range(1, len(correct) + 1):
        assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(brute_force_pass_at_k(correct, k))


def test_mean_and_majority_at_k():
    assert mean_at_k([1.0, 0.0, 1.0, 1.0], 2) == 0.5 and mean_at_k([1.0, 0.0, 1.0, 1.0], 4) == 0.75
    # "a" twice among 4: the majority, wrong (its first sample's reward is 0)
    assert maj_at_k(["a", "b", "a", "c"], [0.0, 1.0, 0.0, 1.0], 4) == 0.0
    assert maj_at_k(["b", "a", "a"], [1.0, 0.0, 0.0], 1) == 1.0  # only "b"
    assert maj_at_k(["b", "a", "a"], [1.0, 0.0, 0.0], 3) == 0.0
    assert maj_at_k(["b", "a", "c"], [1.0, 0.0, 0.0], 3) == 1.0  # a three-way tie: the first answer


def test_eval_metrics_average_over_prompts():
    prompts = [(["x", "y", "x", "x"], [0.0, 1.0, 0.0, 0.0]),  # c = 1: pass@1 0.25, pass@4 1; maj "x" wrong
               (["p", "p", "q", "r"], [1.0, 1.0, 0.0, 0.0])]  # c = 2: pass@1 0.5, pass@4 1; maj "p" right
    m = eval_at_k_metrics(prompts, [1, 4])
    assert m["pass@1"] == pytest.approx((0.25 + 0.5) / 2) and m["pass@4"] == 1.0
    assert m["mean@1"] == pytest.approx(0.5) and m["mean@4"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["maj@1"] == pytest.approx(0.5) and m["maj@4"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 5 samples"):
        eval_at_k_metrics(prompts, [5])


def test_eval_samples_grouped_by_prompt_with_failures_incorrect():
    from types import SimpleNamespace

    from vime.rollout.metrics import eval_at_k
    from vime.data.sample import Sample

    def s(group, response, reward, status=Sample.Status.COMPLETED):
        return Sample(group_index=group, response=response, reward=reward, status=status)

    samples = [s(0, " 7", 1.0), s(0, "7 ", 1.0), s(0, "3", 0.0), s(0, "x", None, Sample.Status.FAILED),
               s(1, "a", 0.0), s(1, "b", 0.0), s(1, "b", 0.0), s(1, "c", 1.0)]
    m = eval_at_k(samples, SimpleNamespace(reward_key=None), [1, 4], prefix="eval/arith")
    # prompt 0: c = 2 of 4 ("7" twice, stripped: the majority, correct); prompt 1: c = 1, majority "b" wrong
    assert m["eval/arith/pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["eval/arith/pass@4"] == 1.0
    assert m["eval/arith/maj@4"] == pytest.approx(0.5)
    assert m["eval/arith/mean@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["eval/arith/maj@1"] == pytest.approx(0.5)  # prompt 0's first sample right, prompt 1's wrong
