"""The checkpoint's tokenizer, loaded without importing torch where the checkpoint names its class.

`AutoTokenizer.from_pretrained` costs about 4 s of a core before it reads a file: transformers' auto module
imports its model registries, and with them torch and dynamo. The processes that only tokenize (the rollout
manager, reward and agent code) never need torch otherwise, and at a run's start they share the cores with the
engines booting. A checkpoint's tokenizer_config.json usually names the class AutoTokenizer would pick
(`tokenizer_class`), and transformers imports that class alone (about 1.3 s). Anything else (no class named, a
class transformers does not export, custom code through `auto_map`) goes through AutoTokenizer as before.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


def load_tokenizer(path: str):
    """The tokenizer of the HF checkpoint directory (or hub name) `path`, as AutoTokenizer would load it."""
    import transformers

    cls = _named_class(Path(path) / "tokenizer_config.json")
    if cls is not None:
        tokenizer_class = getattr(transformers, cls, None)
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@functools.cache
def shared_tokenizer(path: str):
    """`load_tokenizer(path)`, loaded once per process (callers only read it: encode, decode, chat templates)."""
    return load_tokenizer(path)


def _named_class(config_file: Path) -> str | None:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("auto_map"):
        return None
    name = config.get("tokenizer_class")
    return name if isinstance(name, str) and name.isidentifier() else None
