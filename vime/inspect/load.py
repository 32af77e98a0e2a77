"""What the inspector shows, read from a run's output directory: the compact rollouts in <output-dir>/rollouts/
(`vime.rollout.debug_data.save_compact_rollout`), the training ranks' records of them beside them (their per-token
log-probs and advantages, `vime.data.saved_rollouts`), the run's flags (config.yaml) and metrics (metrics.jsonl),
and the per-sample figures derived from them (token pieces, group advantages where the trainer's are missing, the
tokens to mark). Plain data out; the HTML is `vime.inspect.render`'s."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vime.data.sample import ADAPTER_KEY
from vime.data.saved_rollouts import match_train_records, read_train_records
from vime.rollout.debug_data import ROLLOUTS_DIR, read_compact_rollout

TRAIN_LOG_PROBS_KEY = "train_log_probs"  # metadata[...]: a rollout's own trainer log-probs (a custom rollout's)
MARKED_TOKENS = 5  # tokens marked per sample: the largest train/rollout gaps, else the least likely sampled tokens
_NAME = re.compile(r"^(rollout|eval_(?P<eval>.+))_(?P<id>\d+)\.jsonl\.gz$")


@dataclass
class SampleView:
    """One sample as the page shows it. `pieces[i]` is the text of response token i; `marked` the indices of the
    response tokens to mark, the most notable first; `advantage` the inspector's group-normalised reward (None for a
    sample without a numeric reward); `train_advantages` the trainer's per-token advantages, where it saved them."""
    raw: dict
    prompt_text: str
    pieces: list[str]
    reward: float | None
    advantage: float | None
    source: str
    marked: list[int]
    train_log_probs: list[float] | None
    train_advantages: list[float] | None = None

    @property
    def failure(self) -> dict | None:
        return (self.raw.get("metadata") or {}).get("failure")


@dataclass
class RolloutView:
    name: str  # the file's stem: rollout_3, eval_math_4
    rollout_id: int
    eval_set: str | None
    samples: list[SampleView]
    metrics: dict = field(default_factory=dict)
    advantages_note: str = ""
    pages: list[str] = field(default_factory=list)  # the file stems of the rollout's pages, when it has several
    page: int = 0  # which of them this view is


def page_chunks(response_lengths: list[int], max_tokens: int) -> list[range]:
    """Consecutive runs of samples, each of at most `max_tokens` response tokens (a longer sample alone): one
    page each, so that no page grows past what a browser opens quickly (~90 bytes of HTML a token)."""
    chunks, start, tokens = [], 0, 0
    for i, n in enumerate(response_lengths):
        if i > start and tokens + n > max_tokens:
            chunks.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(response_lengths) or not chunks:
        chunks.append(range(start, len(response_lengths)))
    return chunks


def rollout_files(output_dir: Path) -> list[Path]:
    """The compact rollouts of a run, training ones by rollout id, then the eval ones."""
    files = [p for p in (output_dir / ROLLOUTS_DIR).glob("*.jsonl.gz") if _NAME.match(p.name)]

    def key(p: Path):
        m = _NAME.match(p.name)
        return (m["eval"] is not None, m["eval"] or "", int(m["id"]))
    return sorted(files, key=key)


def run_config(output_dir: Path) -> dict:
    path = output_dir / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def run_metrics(output_dir: Path) -> dict[int, dict]:
    """{rollout id: every metric logged for it}, from metrics.jsonl (rows for one rollout merged)."""
    path = output_dir / "metrics.jsonl"
    merged: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            if isinstance(row.get("rollout_id"), int):
                merged.setdefault(row["rollout_id"], {}).update(row)
    return merged


def scalar_reward(reward, reward_key: str | None) -> float | None:
    """The number a reward stands for (`Sample.get_reward_value`'s rule), or None (failed, or a dict without
    --reward-key)."""
    if isinstance(reward, dict):
        reward = reward.get(reward_key) if reward_key else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return None
    return float(reward)


def group_advantages(rewards: list[float | None]) -> list[float | None]:
    """GRPO-style advantages of one group: (r - mean) / (std + 1e-6) over the samples with a reward (population
    std); None for the others. The inspector computes them from the saved rewards; they are not the trainer's."""
    values = [r for r in rewards if r is not None]
    if not values:
        return [None] * len(rewards)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((r - mean) ** 2 for r in values) / len(values))
    return [None if r is None else (r - mean) / (std + 1e-6) for r in rewards]


def marked_tokens(engine: list[float], trainer: list[float] | None, mask: list[int],
                  k: int = MARKED_TOKENS) -> list[int]:
    """Indices of the `k` trained tokens with the largest |trainer - engine| log-prob gap (a NaN one, the trainer's
    non-finite log-prob, counts as the largest), or, without the trainer's log-probs, the `k` trained tokens the
    engine found least likely; the largest gap (least likely token) first."""
    trained = [i for i, m in enumerate(mask) if m]
    if trainer is not None:
        def gap(i: int) -> float:
            d = abs(trainer[i] - engine[i])
            return math.inf if math.isnan(d) else d
        order = sorted(trained, key=lambda i: -gap(i))
    else:
        order = sorted(trained, key=lambda i: engine[i])
    return order[:k]


def _floats(values: list | None, n: int) -> list[float] | None:
    """A saved per-token list of length `n` as floats (None entries, non-finite numbers the writer dropped, as
    NaN), or None when there is none of that length. Its entries were checked (`sample_problem`, `record_problem`)."""
    if not isinstance(values, list) or len(values) != n:
        return None
    return [math.nan if v is None else float(v) for v in values]


# ---- checking what a file holds ---------------------------------------------------------------------------------
# The page puts these fields into HTML attributes and arithmetic. vime writes them as numbers; a file made or edited
# by hand may hold anything, so each is checked before it is used and a wrong one is named in the error.

class RolloutFileError(ValueError):
    """A saved rollout, or the trainer's record of it, holding a field that is not what vime writes there."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers(v, nullable: bool = False) -> bool:
    return isinstance(v, list) and all(_is_number(x) or (nullable and x is None) for x in v)


def _spans(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, list) and len(s) == 3 and _is_int(s[1]) and _is_int(s[2])
                                       for s in v)


# (key, check, what it should be): a sample's fields the page uses, each when present and not null
_SAMPLE_FIELDS = [
    ("index", _is_int, "an integer"),
    ("group_index", _is_int, "an integer"),
    ("response_length", lambda v: _is_int(v) and v >= 0, "a count"),
    ("tokens", lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of token ids"),
    ("rollout_log_probs", _numbers, "a list of numbers"),
    ("loss_mask", lambda v: isinstance(v, list) and all(isinstance(m, int) for m in v), "a list of integers"),
    ("status", lambda v: isinstance(v, str), "a string"),
    ("metadata", lambda v: isinstance(v, dict), "an object"),
    ("weight_versions", lambda v: isinstance(v, list), "a list"),
    ("weight_version_spans", _spans, "a list of [version, start, end]"),
]
_RECORD_FIELDS = [
    ("position", _is_int, "an integer"),
    ("index", _is_int, "an integer"),
    ("group_index", _is_int, "an integer"),
    ("response_length", _is_int, "an integer"),
    ("log_probs", lambda v: _numbers(v, nullable=True), "a list of numbers"),
    ("advantages", lambda v: _numbers(v, nullable=True), "a list of numbers"),
]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_problem(row, fields: list) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON object was expected, not {_short(row)}"
    for key, check, what in fields:
        if row.get(key) is not None and not check(row[key]):
            return f"{key} is {_short(row[key])}, not {what}"
    return None


def sample_problem(raw) -> str | None:
    """What makes a saved sample unfit to show (a field not of the type vime writes, per-token lists that do not
    match the response), or None."""
    problem = _field_problem(raw, _SAMPLE_FIELDS)
    if problem:
        return problem
    n, tokens = raw.get("response_length") or 0, raw.get("tokens") or []
    if n > len(tokens):
        return f"response_length {n} is more than its {len(tokens)} tokens"
    for key in ("rollout_log_probs", "loss_mask"):
        if raw.get(key) and len(raw[key]) != n:  # empty: the page shows zeros, ones
            return f"{key} has {len(raw[key])} entries for a response of {n} tokens"
    metadata = raw.get("metadata") or {}
    if metadata.get("failure") is not None and not isinstance(metadata["failure"], dict):
        return f"metadata.failure is {_short(metadata['failure'])}, not an object"
    own = metadata.get(TRAIN_LOG_PROBS_KEY)
    if isinstance(own, list) and not _numbers(own, nullable=True):
        return f"metadata.{TRAIN_LOG_PROBS_KEY} is {_short(own)}, not a list of numbers"
    return None


def record_problem(record) -> str | None:
    """What makes one of the trainer's records unfit to show, or None."""
    return _field_problem(record, _RECORD_FIELDS)


def check_rows(rows: list, problem_of, where: str, row_name: str) -> None:
    """Raise RolloutFileError naming the first row that `problem_of` finds wrong: `where`, then `row_name` and
    its number, counted from 1 (a file's line; the trainer's records over its files in rank order)."""
    for number, row in enumerate(rows, start=1):
        problem = problem_of(row)
        if problem:
            raise RolloutFileError(f"{where}: {row_name} {number}: {problem}")


def trainer_figures(raw: dict, record: dict | None) -> tuple[list[float] | None, list[float] | None]:
    """(the trainer's per-token log-probs, its per-token advantages) of one saved sample: from the training ranks'
    record (`vime.data.saved_rollouts.train_record`), else the log-probs a rollout put in
    metadata[TRAIN_LOG_PROBS_KEY]; None for what neither has."""
    n = raw.get("response_length") or 0
    record = record or {}
    log_probs = _floats(record.get("log_probs"), n) or _floats((raw.get("metadata") or {}).get(TRAIN_LOG_PROBS_KEY), n)
    return log_probs, _floats(record.get("advantages"), n)


COMPUTED_ADVANTAGES_NOTE = ("advantage (computed): by the inspector, GRPO-style: (reward - group mean) / (group std "
                            "+ 1e-6) over the group's samples with a reward; the trainer saved no advantages of "
                            "these samples (an eval set, a --debug-rollout-only run, a rollout not trained, an "
                            "older run)")
TRAINER_ADVANTAGES_NOTE = ("advantages (trainer): the trainer's own, per token (its --advantage-estimator, after "
                           "its reward shaping), and trainer log-probs under the weights the rollout was sampled "
                           "with, saved by the training ranks in rollouts/<rollout>.train.<rank>.jsonl.gz")


def advantages_note(with_trainer: int, total: int) -> str:
    """The page's note on whose advantages it shows: the trainer's, the inspector's, or each for some samples."""
    if with_trainer == total:
        return TRAINER_ADVANTAGES_NOTE
    if with_trainer == 0:
        return COMPUTED_ADVANTAGES_NOTE
    return f"{with_trainer} of {total} samples: {TRAINER_ADVANTAGES_NOTE}. The others: {COMPUTED_ADVANTAGES_NOTE}"


def data_source(sample: dict, eval_set: str | None) -> str:
    """What the page filters by as the data source: metadata["data_source"], else the LoRA adapter, else the eval
    set, else "train"."""
    metadata = sample.get("metadata") or {}
    return str(metadata.get("data_source") or metadata.get(ADAPTER_KEY) or eval_set or "train")


def load_rollout_view(path: Path, tokenizer, reward_key: str | None, metrics: dict | None = None) -> RolloutView:
    m = _NAME.match(path.name)
    raws = read_compact_rollout(path)
    check_rows(raws, sample_problem, str(path), "line")
    rewards = [scalar_reward(s.get("reward"), reward_key) for s in raws]
    advantages: list[float | None] = [None] * len(raws)
    groups: dict[object, list[int]] = {}
    for i, s in enumerate(raws):
        groups.setdefault(s.get("group_index"), []).append(i)
    for members in groups.values():
        for i, a in zip(members, group_advantages([rewards[i] for i in members])):
            advantages[i] = a
    saved_records = read_train_records(path.parent, int(m["id"])) if m["eval"] is None else []
    check_rows(saved_records, record_problem, str(path.parent / f"rollout_{m['id']}.train.*.jsonl.gz"),
               "record")
    records = match_train_records(raws, saved_records)
    samples = []
    for raw, reward, advantage, record in zip(raws, rewards, advantages, records):
        tokens, n = raw.get("tokens") or [], raw.get("response_length") or 0
        prompt_ids, response_ids = tokens[:len(tokens) - n], tokens[len(tokens) - n:]
        engine = raw.get("rollout_log_probs") or [0.0] * n
        mask = raw.get("loss_mask") if raw.get("loss_mask") is not None else [1] * n
        trainer, trainer_advantages = trainer_figures(raw, record)
        samples.append(SampleView(
            raw=raw, prompt_text=tokenizer.decode(prompt_ids, skip_special_tokens=False),
            pieces=[tokenizer.decode([t], skip_special_tokens=False) for t in response_ids],
            reward=reward, advantage=advantage, source=data_source(raw, m["eval"]),
            marked=marked_tokens(engine, trainer, mask), train_log_probs=trainer,
            train_advantages=trainer_advantages))
    with_trainer = sum(s.train_advantages is not None for s in samples)
    return RolloutView(name=path.name.removesuffix(".jsonl.gz"), rollout_id=int(m["id"]), eval_set=m["eval"],
                       samples=samples, metrics=metrics or {}, advantages_note=advantages_note(with_trainer,
                                                                                               len(samples)))
