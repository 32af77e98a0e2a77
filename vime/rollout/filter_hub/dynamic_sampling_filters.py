"""Dynamic-sampling filters: keep or drop one prompt group (`--dynamic-sampling-filter-path`).

Contract (slime-compatible): `fn(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput`, called by
the rollout once every sample of a group has its reward.
"""

from __future__ import annotations

from dataclasses import dataclass

from vime.data.sample import Sample


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # why the group was dropped; counted in rollout metrics


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop groups whose rewards are all equal: they carry no GRPO advantage signal."""
    if not samples:
        return DynamicFilterOutput(keep=False, reason="empty_group")
    rewards = [sample.get_reward_value(args) for sample in samples]
    # max != min rather than std > 0: no floating-point noise, same answer (a lone sample is dropped).
    if max(rewards) == min(rewards):
        return DynamicFilterOutput(keep=False, reason=f"zero_std_{rewards[0]:g}")
    return DynamicFilterOutput(keep=True)


def check_no_failed_samples(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop groups in which any sample's generation or reward failed."""
    if any(sample.status == Sample.Status.FAILED for sample in samples):
        return DynamicFilterOutput(keep=False, reason="failed_sample")
    return DynamicFilterOutput(keep=True)
