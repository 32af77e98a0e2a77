"""A real headless browser for page tests: Chromium (Debian's `chromium`, installed by scripts/install.sh where apt
is available) loads a page from disk, runs its scripts and prints the DOM it built; `parse_page` reads what the
inspector's pages hold (vime.inspect.render documents the structure)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:  # a package from outside the project's registry: its absence skips, it never fails the suite
        pytest.skip("chromium is not installed (scripts/install.sh installs Debian's chromium where apt-get can)")
    return path


def dump_dom(page: Path, fragment: str = "") -> str:
    """The DOM of `page` (opened as a file:// URL with `fragment`) after its scripts ran."""
    proc = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           page.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout


@dataclass
class SampleSection:
    attrs: dict
    tokens: list[dict] = field(default_factory=list)  # the attributes of each span.tok with data-i
    facts: dict = field(default_factory=dict)  # header facts: {"reward": "1.0", "advantage": "0.9999", ...}


@dataclass
class Page:
    samples: list[SampleSection] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)  # the index's tr.rollout rows, cell texts
    text: str = ""


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__()
        self.page = Page()
        self.fact: str | None = None
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.texts: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "section" and "sample" in classes:
            self.page.samples.append(SampleSection(a))
        elif tag == "span" and "tok" in classes and "data-i" in a:
            self.page.samples[-1].tokens.append(a)
        elif tag == "b" and classes and classes[0].startswith("f-") and self.page.samples:
            self.fact = classes[0][2:]
            self.page.samples[-1].facts[self.fact] = ""
        elif tag == "tr" and "rollout" in classes:
            self.row = []
        elif tag == "td" and self.row is not None:
            self.cell = []

    def handle_endtag(self, tag):
        if tag == "b":
            self.fact = None
        elif tag == "td" and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.page.rows.append(self.row)
            self.row = None

    def handle_data(self, data):
        self.texts.append(data)
        if self.fact is not None:
            self.page.samples[-1].facts[self.fact] += data
        if self.cell is not None:
            self.cell.append(data)


def parse_page(html: str) -> Page:
    reader = _Reader()
    reader.feed(html)
    reader.page.text = "".join(reader.texts)
    return reader.page
