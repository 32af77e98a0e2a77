"""The `Sample`: one prompt + one response as it flows rollout -> reward -> buffer -> trainer.

Field names follow slime so that users' custom functions port over unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vime.config.rollout import RewardConfig


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
    weight_versions: list[int] = field(default_factory=list)  # engine weight versions that produced the tokens
    # [version, start, end]: response tokens [start, end) were sampled by that version (vime.data.weight_versions)
    weight_version_spans: list[list] = field(default_factory=list)
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
        if isinstance(self.reward, dict) and key is None:  # only a dict needs the flag
            key = RewardConfig.of(args).reward_key
        return reward_value(self.reward, key, self.index)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """The inverse of `to_dict`. Raises InvalidSampleError (naming the field) for a dict that breaks the
        contract checked by `check_sample_dict`."""
        check_sample_dict(d)
        d = dict(d)
        d["status"] = cls.Status(d.get("status", cls.Status.PENDING.value))
        number_versions(d)
        return cls(**d)


def number_versions(d: dict) -> None:
    """A checked sample dict's weight versions as vime numbers them, in place: labels saved as strings (older
    rollouts, slime-style code) become ints (`as_version`)."""
    if d.get("weight_versions"):
        d["weight_versions"] = [as_version(v) for v in d["weight_versions"]]
    if d.get("weight_version_spans"):
        d["weight_version_spans"] = [[as_version(v), start, end] for v, start, end in d["weight_version_spans"]]


def reward_value(reward: float | dict[str, Any], key: str | None, index: Any = None) -> float:
    """A sample's scalar reward: `reward` itself, or its field `key` (--reward-key) when the reward function returned
    a dict. `index` names the sample in the error of a dict without a key."""
    if isinstance(reward, dict):
        if not key:
            raise ValueError(f"sample {index}: reward is a dict {sorted(reward)}; set --reward-key")
        return float(reward[key])
    return float(reward)


ADAPTER_KEY = "lora_adapter"  # metadata[ADAPTER_KEY]: the name of the adapter that generates and trains a sample
INITIAL_VERSION_LABEL = "default"  # what vLLM calls the weights an engine started with: vime's version 0


def as_version(label: Any) -> int:
    """A weight version as vime numbers them (0: the checkpoint the run started from, k: after k updates), from
    an engine's label ("3", vLLM's "default" for the weights it started with) or a number."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    text = str(label)
    if text == INITIAL_VERSION_LABEL:
        return 0
    if text.lstrip("-").isdigit():
        return int(text)
    raise ValueError(f"weight version {label!r} is not one vime sets: vime numbers an engine's weights 0 (the "
                     f"checkpoint, vLLM's {INITIAL_VERSION_LABEL!r}), 1, 2, ... as it updates them; an engine whose "
                     "weights someone else labelled cannot be told apart from the run's")


class InvalidSampleError(ValueError):
    """A sample dict that breaks the `Sample` contract; `field` is the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"field {field_name!r}: {message}")
        self.field = field_name


_NONE = type(None)
# field -> the types its value may have; absent fields take the dataclass default. label and the routed experts
# (a numpy array, or nested lists after JSON) are free-form.
_FIELD_TYPES = {
    "group_index": (int, _NONE), "index": (int, _NONE), "prompt": (str, list), "tokens": (list, tuple),
    "response": (str,), "response_length": (int,), "reward": (int, float, dict, _NONE),
    "loss_mask": (list, tuple, _NONE), "rollout_log_probs": (list, tuple, _NONE), "status": (str,),
    "metadata": (dict,), "weight_versions": (list,), "weight_version_spans": (list,),
    "tools": (list, _NONE),
}
_NOT_BOOL = ("group_index", "index", "response_length")  # bool is an int to isinstance; not a count or an id
_SAMPLE_FIELDS = frozenset(f.name for f in dataclasses.fields(Sample))
_STATUSES = frozenset(s.value for s in Sample.Status)


def check_sample_dict(d: Any, vocab_size: int | None = None) -> None:
    """Raise InvalidSampleError unless `d` is a sample dict the trainer can use: known fields of the right types,
    and the values `check_sample_values` checks. Called by `Sample.from_dict` and by the rollout codec's decoder for
    rollouts stored before its typed schema (whose decoder checks the types itself)."""
    if not isinstance(d, dict):
        raise InvalidSampleError("<sample>", f"a sample is a dict, got {type(d).__name__}")
    unknown = sorted(str(k) for k in set(d) - _SAMPLE_FIELDS)
    if unknown:
        raise InvalidSampleError(unknown[0], f"unknown fields {unknown}; Sample has {sorted(_SAMPLE_FIELDS)}")
    for name, types in _FIELD_TYPES.items():
        value = d.get(name)
        if name in d and (not isinstance(value, types) or (name in _NOT_BOOL and isinstance(value, bool))):
            expected = " or ".join("None" if t is _NONE else t.__name__ for t in types)
            raise InvalidSampleError(name, f"expected {expected}, got {type(value).__name__}")
    check_sample_values(d, vocab_size)


def check_sample_values(d: dict, vocab_size: int | None = None) -> None:
    """Raise InvalidSampleError unless the values of a sample dict whose fields have their types fit together: a
    known status, `response_length` within `tokens`, one `loss_mask` entry (0/1) and one finite `rollout_log_probs`
    entry per response token, weight versions and spans vime writes, and token ids in [0, vocab_size) when
    `vocab_size` is given (an id outside it would index past the embedding)."""
    if d.get("status", Sample.Status.PENDING.value) not in _STATUSES:
        raise InvalidSampleError("status", f"{d['status']!r} is not one of {sorted(_STATUSES)}")
    tokens, response_length = d.get("tokens", ()), d.get("response_length", 0)
    _check_numbers("tokens", tokens, integral=True)
    if tokens and (min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size)):
        bad = next(t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size))
        raise InvalidSampleError("tokens", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= response_length <= len(tokens):
        raise InvalidSampleError("response_length", f"{response_length} is not within the {len(tokens)} tokens")
    for name in ("loss_mask", "rollout_log_probs"):
        values = d.get(name)
        if values is not None and len(values) != response_length:
            raise InvalidSampleError(name, f"{len(values)} entries for response_length {response_length} "
                                           f"(one per response token)")
    mask = d.get("loss_mask") or ()
    _check_numbers("loss_mask", mask, integral=True, bools=True)
    if not set(mask) <= {0, 1}:
        raise InvalidSampleError("loss_mask", f"entries are 0 or 1, got {next(m for m in mask if m not in (0, 1))}")
    log_probs = d.get("rollout_log_probs") or ()
    _check_numbers("rollout_log_probs", log_probs, integral=False)
    if not _all_finite(log_probs):
        bad = next(i for i, x in enumerate(log_probs) if not _all_finite((x,)))
        raise InvalidSampleError("rollout_log_probs", f"entry {bad} ({log_probs[bad]!r}) is not a finite number")
    for span in d.get("weight_version_spans") or ():
        if not (isinstance(span, (list, tuple)) and len(span) == 3 and _is_version(span[0])
                and all(isinstance(x, int) and not isinstance(x, bool) for x in span[1:])
                and 0 <= span[1] <= span[2] <= response_length):
            raise InvalidSampleError("weight_version_spans", f"{span!r} is not [version, start, end] with "
                                                             f"0 <= start <= end <= {response_length}")
    for version in d.get("weight_versions") or ():
        if not _is_version(version):
            raise InvalidSampleError("weight_versions", f"{version!r} is not a weight version (0, 1, 2, ...)")


def _is_version(value: Any) -> bool:
    try:
        as_version(value)
    except ValueError:
        return False
    return not isinstance(value, (bool, float, list, dict, tuple))


def _check_numbers(name: str, values, integral: bool, bools: bool = False) -> None:
    if set(map(type, values)) <= ({int} if integral else {int, float}):  # the common case, checked in C
        return
    kind = numbers.Integral if integral else numbers.Real
    bad = [x for x in values if not isinstance(x, kind) or (isinstance(x, bool) and not bools)][:1]
    if bad:  # a list, not next(..., None): a None entry is itself what is wrong
        bad = bad[0]
        raise InvalidSampleError(name, f"entries are {'integers' if integral else 'real numbers'}, "
                                       f"got {type(bad).__name__} {bad!r}")


def _all_finite(values) -> bool:
    try:
        return all(map(math.isfinite, values))
    except OverflowError:  # an int too large for a float
        return False


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
