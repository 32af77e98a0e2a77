"""`<output-dir>/config.yaml`: the run's resolved flags, in the form `--config` reads, to reproduce or inspect a run.

The driver writes it once, before anything starts (`TrainingSession.__enter__`). Every flag is written with the
value the run uses (the command line, a --config file and the defaults, after `validate_args` filled the derived
ones), so `train.py --config <output-dir>/config.yaml` parses to the same flags.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import yaml

# Flags whose value is a secret: never written (a reproduced run gives them again). The control token is read
# from --control-token-file, whose path (not its contents) is written like any flag.
SECRET_FLAG = re.compile(r"(api_key|hf_token|password|secret|wandb_key)$")

# Namespace entries that are not flags of their own: --config names the file this one replaces, and
# vllm_raw_cli is the --vllm-* tokens, rebuilt from the vllm_* flags when they are parsed again.
NOT_FLAGS = {"config", "vllm_raw_cli"}

HEADER = ("# The resolved flags of this run (command line, --config and defaults). Reproduce the run with\n"
          "#   python train.py --config {path}\n"
          "# Secret flags (api keys, tokens) are not written: give them again on the command line.\n")


def plain_values(args: argparse.Namespace) -> dict:
    """{dest: value} of `args` as YAML's and JSON's safe subset holds them, secrets left out (what wandb's run
    config shows)."""
    return {dest: _plain(value) for dest, value in vars(args).items() if not SECRET_FLAG.search(dest)}


def resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """{flag name without "--": value} for every flag of `parser` in `args`, as `config_to_argv` reads them back.
    Entries no flag sets (derived ones such as use_critic, which validation fills again) are left out."""
    names = {}  # dest -> the flag's name (a few differ from their dest, e.g. --router-wasm-middleware-route)
    negations = {}  # dest -> a flag that only sets it false (--no-masked-softmax-fusion, --disable-bias-linear)
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if isinstance(action, argparse._StoreFalseAction) and action.option_strings:
            negations.setdefault(action.dest, action.option_strings[0][2:])
        elif longs:
            names.setdefault(action.dest, longs[0][2:])
    resolved = {}
    for dest, value in plain_values(args).items():
        if dest in NOT_FLAGS:
            continue
        if dest in names:
            resolved[names[dest]] = value
        elif dest in negations and value is False:
            resolved[negations[dest]] = True  # the negating flag given
    return resolved


def _plain(value):
    """The value as YAML's safe subset holds it: tuples as lists, paths as strings; anything else as its str(),
    which is what a flag's type converter reads (every flag's value came from a command-line string)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def write_resolved_config(args: argparse.Namespace, path: str | Path, parser: argparse.ArgumentParser) -> Path:
    """Write `resolved_config(args, parser)` to `path` (through a temporary file: a reader never sees half of it).
    `parser` is the run's (`vime.arguments.build_parser()`), which this layer cannot build itself."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(resolved_config(args, parser), sort_keys=False, allow_unicode=True, width=120)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(HEADER.format(path=path) + body, encoding="utf-8")
    os.replace(tmp, path)
    return path
