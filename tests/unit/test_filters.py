"""Dynamic-sampling filters and buffer filters."""

from types import SimpleNamespace

import pytest

from vime.data.sample import Sample
from vime.rollout.filter_hub import DynamicFilterOutput, check_no_failed_samples, check_reward_nonzero_std, pop_first

ARGS = SimpleNamespace(reward_key=None)


def group(*rewards, status=Sample.Status.COMPLETED):
    return [Sample(index=i, reward=r, status=status) for i, r in enumerate(rewards)]


def test_nonzero_std_keeps_mixed_groups():
    assert check_reward_nonzero_std(ARGS, group(0.0, 1.0, 1.0)) == DynamicFilterOutput(keep=True, reason=None)


@pytest.mark.parametrize("rewards,reason", [((1.0, 1.0, 1.0), "zero_std_1"), ((0.0, 0.0), "zero_std_0"),
                                            ((-1.0,), "zero_std_-1"), ((0.5, 0.5), "zero_std_0.5")])
def test_nonzero_std_drops_uniform_groups(rewards, reason):
    out = check_reward_nonzero_std(ARGS, group(*rewards))
    assert not out.keep and out.reason == reason


def test_nonzero_std_empty_group():
    assert check_reward_nonzero_std(ARGS, []) == DynamicFilterOutput(keep=False, reason="empty_group")


def test_nonzero_std_uses_reward_key():
    samples = [Sample(reward={"acc": 1.0, "len": float(i)}) for i in range(3)]
    assert not check_reward_nonzero_std(SimpleNamespace(reward_key="acc"), samples).keep
    assert check_reward_nonzero_std(SimpleNamespace(reward_key="len"), samples).keep
    with pytest.raises(ValueError, match="set --reward-key"):
        check_reward_nonzero_std(ARGS, samples)


def test_nonzero_std_accepts_extra_kwargs():
    assert check_reward_nonzero_std(ARGS, group(0.0, 1.0), rollout_id=3).keep


def test_no_failed_samples():
    samples = group(0.0, 1.0)
    assert check_no_failed_samples(ARGS, samples).keep
    samples[1].status = Sample.Status.FAILED
    assert check_no_failed_samples(ARGS, samples) == DynamicFilterOutput(keep=False, reason="failed_sample")
    assert check_no_failed_samples(ARGS, group(1.0, status=Sample.Status.TRUNCATED)).keep


def test_pop_first_removes_from_the_front():
    buffer = [group(float(i)) for i in range(5)]
    first = buffer[:2]
    taken = pop_first(ARGS, buffer, 2)
    assert taken == first and len(buffer) == 3 and buffer[0][0].reward == 2.0
    assert pop_first(ARGS, buffer, 10) == [group(2.0), group(3.0), group(4.0)]
    assert buffer == []
    assert pop_first(ARGS, buffer, 1) == []
    assert pop_first(ARGS, [group(1.0)], 0) == []
    with pytest.raises(ValueError):
        pop_first(ARGS, buffer, -1)
