"""Prompt datasets: JSONL / Parquet rows -> `Sample`s with prompt tokens.

A malformed row (not JSON, not an object, missing the input key, bad chat messages, a JSONL line over
MAX_ROW_BYTES, ...) is skipped with a warning naming file:line and the reason, and counted; loading fails with a
clear error when every row is bad or more than --max-bad-prompt-rows-ratio of them are (then the file, or a flag
such as --input-key, is wrong).

A line is never read past MAX_ROW_BYTES, and a prompt longer than --rollout-max-prompt-len could possibly fit
(`prompt_char_bound`) is dropped without being tokenized: a file of gigabyte lines costs neither the memory nor
the minutes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterator

from vime.config.rollout import PromptDataConfig
from vime.data.sample import Sample

logger = logging.getLogger(__name__)
# A prompt row (messages, tools, metadata) is kilobytes; a line this long is a wrong file or a broken export.
MAX_ROW_BYTES = 64 * 2**20
_SKIP_CHUNK_BYTES = 2**20  # what the rest of an over-long line is read (and dropped) in


class DataFormatError(ValueError):
    """A row of a prompt file is malformed; the message names the file and line."""


class PromptTooLong(Exception):
    """A row's prompt is over --rollout-max-prompt-len: dropped and counted, not a malformed row."""


@dataclasses.dataclass
class PromptFile:
    """What loading a prompt file found: the usable prompts, the rows skipped (with reasons), over-long prompts."""

    samples: list[Sample]
    skipped: list[str]  # "file:line: reason", one per malformed row
    too_long: int  # prompts over --rollout-max-prompt-len, dropped


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | DataFormatError]]:
    """Yield (line number starting at 1, row dict or the DataFormatError of a malformed line)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    with path.open("rb") as f:  # bytes: a line of bad UTF-8 is a bad row, not silently rewritten text
        for i, raw in _bounded_lines(f, MAX_ROW_BYTES):
            if raw is None:
                yield i, DataFormatError(f"{path}:{i}: the line is over {MAX_ROW_BYTES} bytes, far more than a "
                                         "prompt row; not read (a wrong file, or rows that lost their newlines?)")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, DataFormatError(f"{path}:{i}: not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield i, DataFormatError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            except RecursionError:
                yield i, DataFormatError(f"{path}:{i}: JSON nested too deep to parse")
                continue
            if not isinstance(row, dict):
                yield i, DataFormatError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
                continue
            yield i, row


def _bounded_lines(f, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, the line) of a binary file, None for a line over `limit` bytes (its newline aside),
    of which no more than `limit` + 1 bytes are held at once."""
    number = 0
    while raw := f.readline(limit + 1):
        number += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield number, raw
            continue
        while (rest := f.readline(_SKIP_CHUNK_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield number, None


def prompt_char_bound(tokenizer, max_tokens: int | None) -> int | None:
    """The most characters a prompt of at most `max_tokens` tokens can have: a token stands for at most as many
    characters as its vocabulary entry is long. None without a limit, or a tokenizer without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if max_tokens is None or get_vocab is None:
        return None
    return max_tokens * max(map(len, get_vocab()), default=1)


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: prompt must be a string or a non-empty list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataFormatError(f"{where}: each chat message needs 'role' and 'content', got {m!r}"[:300])
    return messages


def _json_field(value: Any, name: str, where: str) -> Any:
    """Parquet often stores nested values as JSON strings."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        raise DataFormatError(f"{where}: {name!r} is a string but not JSON") from None


def row_to_sample(row: dict[str, Any], where: str, tokenizer, args, max_chars: int | None = None) -> Sample:
    """One row -> a prompt Sample; raises DataFormatError naming `where` (file:line) when the row is malformed,
    PromptTooLong, before tokenizing it, when its text is over `max_chars` (`prompt_char_bound`)."""
    prompt_data = PromptDataConfig.of(args)
    if prompt_data.input_key not in row:
        raise DataFormatError(f"{where}: missing key {prompt_data.input_key!r} (--input-key); row has {sorted(row)}")
    prompt = row[prompt_data.input_key]
    label = None
    if prompt_data.label_key is not None:
        if prompt_data.label_key not in row:
            raise DataFormatError(f"{where}: missing key {prompt_data.label_key!r} (--label-key)")
        label = row[prompt_data.label_key]
    metadata = _json_field(row.get(prompt_data.metadata_key) or {}, prompt_data.metadata_key, where)
    if not isinstance(metadata, dict):
        raise DataFormatError(f"{where}: {prompt_data.metadata_key!r} must be a dict, got {type(metadata).__name__}")
    tools = _json_field(row.get(prompt_data.tool_key), prompt_data.tool_key, where) if prompt_data.tool_key else None

    if prompt_data.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = _check_messages(messages, where)
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                 **(prompt_data.apply_chat_template_kwargs or {}))
        except Exception as e:  # a template error on one row's content (e.g. a non-string content)
            raise DataFormatError(f"{where}: chat template failed: {type(e).__name__}: {e}"[:300]) from None
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise DataFormatError(f"{where}: prompt is a {type(prompt).__name__}, not a string; for a list of chat "
                              "messages pass --apply-chat-template")
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(f"{where}: {len(text)} characters, more than any prompt within the token limit")
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not token_ids:
        raise DataFormatError(f"{where}: prompt is empty")
    return Sample(prompt=text, tokens=list(token_ids), label=label, metadata=dict(metadata), tools=tools)


def load_prompt_file(path: str | Path, tokenizer, args) -> PromptFile:
    """Read a prompt file, skipping malformed rows within the tolerance (see the module docstring).

    Uses args.input_key, label_key, metadata_key, tool_key, apply_chat_template(_kwargs),
    rollout_max_prompt_len (longer prompts are dropped and counted) and max_bad_prompt_rows_ratio.
    """
    prompt_data = PromptDataConfig.of(args)
    samples, skipped, too_long, rows = [], [], 0, 0
    max_len = prompt_data.rollout_max_prompt_len
    max_chars = prompt_char_bound(tokenizer, max_len)
    for line, row in read_rows(path):
        rows += 1
        try:
            if isinstance(row, DataFormatError):
                raise row
            sample = row_to_sample(row, f"{path}:{line}", tokenizer, args, max_chars)
        except DataFormatError as e:
            skipped.append(str(e))
            logger.warning("skipping a malformed prompt row: %s", e)
            continue
        except PromptTooLong:
            too_long += 1
            continue
        if max_len is not None and len(sample.tokens) > max_len:
            too_long += 1
            continue
        samples.append(sample)
    check_bad_rows(path, rows, skipped, prompt_data.max_bad_prompt_rows_ratio)
    if too_long:
        logger.warning("%s: dropped %d prompts longer than --rollout-max-prompt-len %d", path, too_long, max_len)
    if not samples:
        raise DataFormatError(f"{path}: no usable prompts ({rows} rows, {too_long} longer than "
                              f"--rollout-max-prompt-len {max_len})")
    return PromptFile(samples, skipped, too_long)


def check_bad_rows(path, rows: int, skipped: list[str], max_ratio: float) -> None:
    """Raise when every row, or more than `max_ratio` of them, is malformed (the first reasons in the message)."""
    if not skipped:
        return
    examples = "\n  ".join(skipped[:5])
    if len(skipped) == rows:
        raise DataFormatError(f"{path}: all {rows} rows are malformed (wrong file or --input-key / --label-key?); "
                              f"first ones:\n  {examples}")
    if len(skipped) > max_ratio * rows:
        raise DataFormatError(f"{path}: {len(skipped)} of {rows} rows are malformed, more than "
                              f"--max-bad-prompt-rows-ratio {max_ratio}; fix the file or raise the ratio. "
                              f"First ones:\n  {examples}")
    logger.warning("%s: skipped %d malformed rows of %d", path, len(skipped), rows)


def load_prompt_samples(path: str | Path, tokenizer, args) -> list[Sample]:
    """The usable prompts of a file as Samples whose `tokens` are the prompt token ids (see `load_prompt_file`)."""
    return load_prompt_file(path, tokenizer, args).samples
