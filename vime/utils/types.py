"""The `Sample`: one prompt + one response as it flows rollout -> reward -> buffer -> trainer.

Field names follow slime so that users' custom functions port over unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    class Status(str, Enum):
        PENDING = "pending"
        COMPLETED = "completed"  # the model stopped by itself (EOS or a stop string/token)
        TRUNCATED = "truncated"  # hit --rollout-max-response-len
        ABORTED = "aborted"  # cancelled mid-generation (dynamic sampling surplus, engine pause)
        FAILED = "failed"  # generation or reward failed; the reason is in metadata["failure"]

    group_index: int | None = None  # which prompt group this sample belongs to
    index: int | None = None  # globally unique sample id
    prompt: str | list[dict[str, Any]] = ""  # text, or chat messages before the template
    tokens: list[int] = field(default_factory=list)  # prompt tokens followed by response tokens
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None  # one entry per response token; 0 = not trained (tool output, ...)
    rollout_log_probs: list[float] | None = None  # engine log-probs of the response tokens
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)  # engine weight versions that produced the tokens
    tools: list[dict[str, Any]] | None = None  # tool schemas offered to the model, if any
    # --use-rollout-routing-replay: the experts the engine routed each forwarded token to, [len(tokens) - 1, layers,
    # top-k] (the last token is sampled, never forwarded); a numpy integer array, nested lists after JSON
    rollout_routed_experts: Any = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def get_reward_value(self, args=None, key: str | None = None) -> float:
        """The scalar reward; `--reward-key` picks a field when the reward function returns a dict."""
        key = key or getattr(args, "reward_key", None)
        if isinstance(self.reward, dict):
            if not key:
                raise ValueError(f"sample {self.index}: reward is a dict {sorted(self.reward)}; set --reward-key")
            return float(self.reward[key])
        return float(self.reward)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown fields {sorted(unknown)}")
        d = dict(d)
        d["status"] = cls.Status(d.get("status", cls.Status.PENDING.value))
        return cls(**d)


@dataclass
class RolloutFnTrainOutput:
    """What a rollout function returns for training (slime's contract): the groups of samples, and metrics that no
    sample carries (logged with the rollout's own, e.g. {"rollout/dropped_groups": 2.0}). A rollout function may
    also return the bare list of groups."""

    samples: list[list[Sample]]
    metrics: dict[str, float] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What a rollout function returns with evaluation=True: {eval set name: samples}, and extra metrics. A bare
    dict also works."""

    data: dict[str, list[Sample]]
    metrics: dict[str, float] | None = None


def as_rollout_output(output, evaluation: bool) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """A rollout function's answer in its output type (bare lists and dicts are wrapped)."""
    if evaluation:
        return output if isinstance(output, RolloutFnEvalOutput) else RolloutFnEvalOutput(output)
    return output if isinstance(output, RolloutFnTrainOutput) else RolloutFnTrainOutput(output)
