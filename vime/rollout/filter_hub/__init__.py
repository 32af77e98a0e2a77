"""Filters: which prompt groups a dynamic-sampling rollout keeps, and which groups leave the buffer."""

from .buffer_filters import pop_first
from .dynamic_sampling_filters import DynamicFilterOutput, check_no_failed_samples, check_reward_nonzero_std

__all__ = ["DynamicFilterOutput", "check_no_failed_samples", "check_reward_nonzero_std", "pop_first"]
