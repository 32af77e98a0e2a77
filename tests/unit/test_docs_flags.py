"""The flag reference (docs/reference/flags.md) is generated from the parser: it lists exactly the flags
`train.py --help` lists, and the committed file is what `python -m vime.docs_flags` writes today."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vime.docs_flags import DEFAULT_PATH, render

REPO = Path(__file__).resolve().parents[2]


def help_flags(help_text: str) -> set[str]:
    """Every option string of argparse's help: the lines that start with two spaces and a dash, split at ", "."""
    flags = set()
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags.update(part.split()[0] for part in invocation.split(", ") if part.startswith("-"))
    return flags


def reference_flags(markdown: str) -> set[str]:
    return {flag for line in markdown.splitlines() if line.startswith("### ")
            for flag in re.findall(r"`(-[^`\s]+)`", line)}


def test_flag_reference_lists_exactly_the_flags_of_train_help():
    proc = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = help_flags(proc.stdout)
    assert {"-h", "--help", "--hf-checkpoint", "--no-save-rollouts", "--vllm-max-model-len", "--lr"} <= listed
    assert len(listed) > 700
    assert reference_flags(DEFAULT_PATH.read_text(encoding="utf-8")) == listed


def test_committed_flag_reference_is_current():
    from vime.arguments import build_parser

    assert DEFAULT_PATH == REPO / "docs" / "reference" / "flags.md"
    assert DEFAULT_PATH.read_text(encoding="utf-8") == render(build_parser()), \
        "docs/reference/flags.md is out of date: run python -m vime.docs_flags"
