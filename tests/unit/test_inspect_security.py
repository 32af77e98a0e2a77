"""The inspector's pages against a hostile rollout file (one made or edited by hand, not by vime): what it holds
cannot add an attribute, an element or a script to the page; each page carries a Content-Security-Policy that runs
only its own inline script and style (by their hashes); bidi control characters are shown, not obeyed, and the
model's text is isolated; the pages are the owner's alone (0600 in a 0700 folder)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import stat
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers.browser import dump_dom, parse_page
from tests.unit.test_inspect import CharTokenizer
from vime.inspect import load, render
from vime.inspect.__main__ import main as inspect_main
from vime.inspect.load import RolloutView, SampleView, load_rollout_view

INJECTED = '1" onmouseover="alert(1)" x="'  # a "number" that closes its attribute and opens an event handler
TAG = '"><img src=x onerror="alert(2)">'  # a string that closes its tag and opens another
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
# the attributes each element of a page may have: the page's own, none a rollout could add
ATTRIBUTES = {
    "section": {"class", "data-index", "data-group", "data-status", "data-source", "data-reward", "data-spans"},
    "span": {"class", "id", "data-i", "data-lp", "data-train-lp", "data-adv"},
    "meta": {"charset", "http-equiv", "content"}, "html": {"lang"}, "details": {"open"}, "a": {"class", "href"},
    "input": {"id", "type", "step", "size"}, "select": {"id"}, "option": {"value"}, "div": {"class", "dir"},
    "p": {"class"}, "b": {"class"}, "tr": {"class"}, "td": {"class"},
}


def _write_rollout(output_dir: Path, name: str, rows: list) -> Path:
    """A rollout file as a hand would make it: the rows as given, no rounding or checking on the way."""
    path = output_dir / "rollouts" / f"{name}.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _row(response: str = "ab", **fields) -> dict:
    tokens = [ord(c) for c in "Q?" + response]
    n = len(response)
    return {"index": 0, "group_index": 0, "tokens": tokens, "response_length": n, "reward": 1.0,
            "rollout_log_probs": [-0.5] * n, "loss_mask": [1] * n, "status": "completed", **fields}


class _Page(HTMLParser):
    """Every element of a page with its attributes and the stack of elements around it, and each text with that
    stack; the text of each <script> and <style>."""
    VOID = {"meta", "input", "br", "img", "link", "hr"}

    def __init__(self, html: str):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.elements: list[tuple[str, dict]] = []
        self.texts: list[tuple[str, list[tuple[str, dict]]]] = []
        self.inline: dict[str, list[str]] = {"script": [], "style": []}
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        element = (tag, dict(attrs))
        self.elements.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] in self.inline:
            self.inline[self.stack[-1][0]].append(data)
        self.texts.append((data, list(self.stack)))

    def attrs_of(self, tag: str) -> list[dict]:
        return [a for t, a in self.elements if t == tag]

    def policy(self) -> dict[str, list[str]]:
        [meta] = [a for a in self.attrs_of("meta") if a.get("http-equiv") == "Content-Security-Policy"]
        directives = (d.split() for d in meta["content"].split(";") if d.strip())
        return {d[0]: d[1:] for d in directives}


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def _hostile_view() -> RolloutView:
    """A rollout view as a hostile file would give it were nothing checked on loading: text in every field the
    page puts into an attribute, the numbers included (the trainer's advantages stay numbers: the header does
    arithmetic on them)."""
    raw = _row("ab", index=INJECTED, group_index=TAG, status=INJECTED, rollout_log_probs=[INJECTED, TAG],
               weight_version_spans=[[TAG, 0, 2]], weight_versions=[TAG])
    sample = SampleView(raw=raw, prompt_text=TAG, pieces=[TAG, INJECTED], reward=None, advantage=None, source=TAG,
                        marked=[], train_log_probs=[INJECTED, TAG], train_advantages=[0.5, -0.5])
    return RolloutView(name=f"eval_{TAG}_3", rollout_id=3, eval_set=TAG, samples=[sample], pages=[f"eval_{TAG}_3", TAG])


def test_hostile_values_add_no_attribute_or_element_and_come_back_as_written():
    view = _hostile_view()
    for html in (render.rollout_page(view), render.index_page(TAG, [view])):
        page = _Page(html)
        handlers = [(t, k) for t, a in page.elements for k in a if k.startswith("on")]
        assert handlers == []
        assert {t for t, _ in page.elements} <= set(ATTRIBUTES) | {"title", "style", "script", "h1", "h2", "summary",
                                                                  "table", "th", "bdi", "head", "body"}
        assert [a for t, a in page.elements if t == "script"] in ([], [{}])  # only the page's own, inline
        added = [(t, sorted(set(a) - ATTRIBUTES.get(t, set()))) for t, a in page.elements]
        assert [(t, names) for t, names in added if names] == []
    page = _Page(render.rollout_page(view))
    [section] = page.attrs_of("section")
    assert section["data-index"] == INJECTED and section["data-group"] == TAG and section["data-status"] == INJECTED
    assert section["data-source"] == TAG and json.loads(section["data-spans"]) == [[TAG, 0, 2]]
    tokens = [a for a in page.attrs_of("span") if "data-i" in a]
    assert [(t["data-lp"], t["data-train-lp"], t["data-adv"]) for t in tokens] == [
        (repr(INJECTED), repr(INJECTED), "0.5"), (repr(TAG), repr(TAG), "-0.5")]
    assert [unquote(a["href"]) for a in page.attrs_of("a")] == ["index.html", f"{TAG}.html"]


@pytest.mark.parametrize("fields, problem", [
    ({"index": INJECTED}, "index is "),
    ({"group_index": [1]}, "group_index is "),
    ({"response_length": "2"}, "response_length is "),
    ({"tokens": [81, "63", 97, 98]}, "tokens is "),
    ({"rollout_log_probs": [-0.5, INJECTED]}, "rollout_log_probs is "),
    ({"rollout_log_probs": [-0.5, True]}, "rollout_log_probs is "),
    ({"rollout_log_probs": [-0.5]}, "rollout_log_probs has 1 entries for a response of 2 tokens"),
    ({"loss_mask": ["1", 1]}, "loss_mask is "),
    ({"status": 3}, "status is "),
    ({"weight_version_spans": [["1", "0", 2]]}, "weight_version_spans is "),
    ({"metadata": {"failure": "oops"}}, "metadata.failure is "),
    ({"metadata": {load.TRAIN_LOG_PROBS_KEY: [INJECTED, -1.0]}}, f"metadata.{load.TRAIN_LOG_PROBS_KEY} is "),
    ({"response_length": 9}, "response_length 9 is more than its 4 tokens"),
])
def test_loading_names_the_line_and_field_that_is_not_a_number(tmp_path, fields, problem):
    path = _write_rollout(tmp_path, "rollout_0", [_row(), _row(**fields)])
    with pytest.raises(load.RolloutFileError, match=f"rollout_0.jsonl.gz: line 2: {problem}"):
        load_rollout_view(path, CharTokenizer(), None)


def test_loading_names_a_trainer_record_that_is_not_a_number(tmp_path):
    _write_rollout(tmp_path, "rollout_0", [_row()])
    with gzip.open(tmp_path / "rollouts" / "rollout_0.train.0.jsonl.gz", "wt") as f:
        f.write(json.dumps({"position": 0, "index": 0, "group_index": 0, "response_length": 2,
                            "log_probs": [-0.5, INJECTED], "advantages": [1.0, 1.0]}) + "\n")
    with pytest.raises(load.RolloutFileError, match=r"rollout_0\.train\.\*\.jsonl\.gz: record 1: log_probs is "):
        load_rollout_view(tmp_path / "rollouts" / "rollout_0.jsonl.gz", CharTokenizer(), None)


def test_csp_allows_exactly_the_pages_inline_script_and_style(tmp_path):
    _write_rollout(tmp_path, "rollout_0", [_row("hi"), _row("yo", index=1)])
    view = load_rollout_view(tmp_path / "rollouts" / "rollout_0.jsonl.gz", CharTokenizer(), None)
    for html, scripts in ((render.rollout_page(view), 1), (render.index_page("run", [view]), 0)):
        page = _Page(html)
        policy = page.policy()
        assert policy["default-src"] == ["'none'"] and policy["base-uri"] == ["'none'"]
        assert len(page.inline["script"]) == scripts and len(page.inline["style"]) == 1
        assert policy["script-src"] == ([_sha256(s) for s in page.inline["script"]] or ["'none'"])
        assert policy["style-src"] == [_sha256(s) for s in page.inline["style"]]
        assert [t for t, _ in page.elements[:3]] == ["html", "head", "meta"]  # the policy precedes what it governs
        assert page.elements[3][1].get("http-equiv") == "Content-Security-Policy"


def test_browser_runs_the_pages_script_and_no_other(tmp_path):
    """Chromium enforces the policy: the page's own script runs (it counts the samples) and its own style applies
    (the body's 1.5em margin), a script added to the page does not run, unless its hash is added to the policy (as
    tests/e2e's hover check does)."""
    _write_rollout(tmp_path, "rollout_0", [_row("hi"), _row("yo", index=1)])
    html = render.rollout_page(load_rollout_view(tmp_path / "rollouts" / "rollout_0.jsonl.gz", CharTokenizer(), None))
    probe = "document.body.setAttribute('data-probe', getComputedStyle(document.body).marginTop);"
    with_probe = html.replace("</body>", f"<script>{probe}</script></body>")
    (tmp_path / "added.html").write_text(with_probe, encoding="utf-8")
    (tmp_path / "allowed.html").write_text(
        with_probe.replace("script-src ", f"script-src {_sha256(probe)} "), encoding="utf-8")
    added = dump_dom(tmp_path / "added.html")
    assert "2 of 2 samples shown" in parse_page(added).text and "<body data-probe" not in added
    allowed = dump_dom(tmp_path / "allowed.html")
    assert "2 of 2 samples shown" in parse_page(allowed).text and '<body data-probe="21px">' in allowed


def _isolating(stack: list[tuple[str, dict]]) -> bool:
    """Inside an element whose text cannot reorder what is around it: <bdi>, one with dir, one the page's CSS
    isolates, or <title> and <option>, which hold plain text."""
    return any(t in ("bdi", "b", "td", "th", "option", "title") or "dir" in a for t, a in stack)


def test_bidi_controls_are_shown_and_the_models_text_isolated(tmp_path):
    text = f"«{BIDI}»"  # the guillemets: where the model's text starts and ends
    failure = {"stage": text, "reason": text, "error": text}
    _write_rollout(tmp_path, f"eval_{BIDI}_0", [_row(text, metadata={"data_source": text, "failure": failure},
                                                     reward={text: 1.0})])
    [path] = load.rollout_files(tmp_path)
    view = load_rollout_view(path, CharTokenizer(), None)
    view.metrics = {text: text}
    markers = "".join(f'<span class="ctl">\\u{ord(c):04x}</span>' for c in BIDI)
    for html in (render.rollout_page(view), render.index_page(text, [view])):
        assert not any(c in html for c in BIDI)  # none is left to act
        page = _Page(html)
        shown = [(data, stack) for data, stack in page.texts if "«" in data or "»" in data or "\\u" in data]
        assert shown and all(_isolating(stack) for data, stack in shown if stack[-1][0] not in ("script", "style")), [
            (d, [t for t, _ in s]) for d, s in shown if not _isolating(s)]
    page = render.rollout_page(view)
    assert f'data-source="«{BIDI.encode("unicode_escape").decode()}»"' in page  # spelled out in attributes
    assert f'<b class="f-data">«{markers}»</b>' in page and f"<td>&quot;«{markers}»&quot;</td>" in page
    assert page.count(f"<bdi>«{markers}»</bdi>") == 2  # the failure's stage and error
    [link] = [a["href"] for a in _Page(render.index_page("run", [view])).attrs_of("a")]
    assert unquote(link) == f"eval_{BIDI}_0.html"  # percent-encoded, the link still finds the page


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("hf-checkpoint: /nonexistent\n")
    monkeypatch.setattr("vime.utils.hf_tokenizer.load_tokenizer", lambda path: CharTokenizer())
    old = os.umask(0o022)  # the common default, under which a plain write is 0644
    yield tmp_path
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_pages_are_written_0600_in_new_folders_0700(run_dir):
    _write_rollout(run_dir, "rollout_0", [_row()])
    out = run_dir / "new" / "inspect"
    assert inspect_main([str(run_dir), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "rollout_0.html"]
    assert [_mode(p) for p in sorted(out.iterdir())] == [0o600, 0o600]
    assert (_mode(out), _mode(out.parent)) == (0o700, 0o700)


def test_rewriting_a_page_neither_keeps_its_mode_nor_follows_a_link_in_its_place(run_dir):
    _write_rollout(run_dir, "rollout_0", [_row()])
    out = run_dir / "inspect"
    out.mkdir(mode=0o755)
    victim = run_dir / "victim.txt"
    victim.write_text("keep")
    (out / "rollout_0.html").symlink_to(victim)
    (out / "index.html").write_text("old")
    os.chmod(out / "index.html", 0o644)
    assert inspect_main([str(run_dir)]) == 0
    assert victim.read_text() == "keep"
    assert [(p.name, p.is_symlink(), _mode(p)) for p in sorted(out.iterdir())] == [
        ("index.html", False, 0o600), ("rollout_0.html", False, 0o600)]
    assert _mode(out) == 0o755  # a folder that was there is the user's: left as it is


def test_cli_skips_a_hostile_rollout_and_says_which_line(run_dir, capsys):
    _write_rollout(run_dir, "rollout_0", [_row()])
    _write_rollout(run_dir, "rollout_1", [_row(), _row(index=INJECTED)])
    assert inspect_main([str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert "skipped " in err and "rollout_1.jsonl.gz: line 2: index is '1\" onmouseover" in err
    assert sorted(p.name for p in (run_dir / "inspect").iterdir()) == ["index.html", "rollout_0.html"]
