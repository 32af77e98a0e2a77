"""Prompt datasets: JSONL / Parquet rows -> `Sample`s with prompt tokens.

Bad rows fail loudly with the file and line (row) number, never silently.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

from vime.utils.types import Sample

logger = logging.getLogger(__name__)


class DataFormatError(ValueError):
    """A row of a prompt file is malformed; the message names the file and line."""


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number starting at 1, row dict) from a .jsonl/.json-lines or .parquet file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataFormatError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            yield i, row


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: prompt must be a string or a non-empty list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataFormatError(f"{where}: each chat message needs 'role' and 'content', got {m!r}"[:300])
    return messages


def load_prompt_samples(path: str | Path, tokenizer, args) -> list[Sample]:
    """Read a prompt file into Samples whose `tokens` are the prompt token ids (response empty).

    Uses args.input_key, label_key, metadata_key, tool_key, apply_chat_template(_kwargs) and
    rollout_max_prompt_len (over-long prompts are dropped and counted in the log).
    """
    samples, too_long = [], 0
    template_kwargs = args.apply_chat_template_kwargs or {}
    for line, row in read_rows(path):
        where = f"{path}:{line}"
        if args.input_key not in row:
            raise DataFormatError(f"{where}: missing key {args.input_key!r} (--input-key); row has {sorted(row)}")
        prompt = row[args.input_key]
        label = None
        if args.label_key is not None:
            if args.label_key not in row:
                raise DataFormatError(f"{where}: missing key {args.label_key!r} (--label-key)")
            label = row[args.label_key]
        metadata = row.get(args.metadata_key) or {}
        if isinstance(metadata, str):  # Parquet often stores nested dicts as JSON strings
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                raise DataFormatError(f"{where}: {args.metadata_key!r} is a string but not JSON") from None
        if not isinstance(metadata, dict):
            raise DataFormatError(f"{where}: {args.metadata_key!r} must be a dict, got {type(metadata).__name__}")
        tools = row.get(args.tool_key) if args.tool_key else None
        if isinstance(tools, str):
            tools = json.loads(tools)

        if args.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            messages = _check_messages(messages, where)
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise DataFormatError(f"{where}: prompt is a list of messages; pass --apply-chat-template")
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not token_ids:
            raise DataFormatError(f"{where}: prompt is empty")
        if args.rollout_max_prompt_len is not None and len(token_ids) > args.rollout_max_prompt_len:
            too_long += 1
            continue
        samples.append(Sample(prompt=text, tokens=list(token_ids), label=label, metadata=dict(metadata), tools=tools))
    if too_long:
        logger.warning("%s: dropped %d prompts longer than --rollout-max-prompt-len %d",
                       path, too_long, args.rollout_max_prompt_len)
    if not samples:
        raise DataFormatError(f"{path}: no usable prompts")
    return samples
