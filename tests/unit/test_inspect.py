"""The rollout inspector's pure parts: the compact rollouts a run keeps (round trip, size cap), the flags that
control them, group advantages and marked tokens against hand-computed values, and HTML escaping of what the
model wrote. The pages of a real run, in a real browser, are checked in tests/e2e/test_multi_turn_e2e.py."""

from __future__ import annotations

import gzip
import json
import os
from html.parser import HTMLParser

import pytest

from vime.arguments import build_parser, config_to_argv
from vime.inspect.__main__ import main as inspect_main
from vime.inspect.load import (group_advantages, load_rollout_view, marked_tokens, page_chunks, rollout_files,
                               scalar_reward)
from vime.data.sample import Sample
from vime.inspect.render import rollout_page
from vime.rollout.arguments import validate_rollout_args
from vime.rollout.debug_data import compact_rollout_path, read_compact_rollout, save_compact_rollout
from vime.utils.resolved_config import write_resolved_config


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def _sample(index, group, response: str, reward, mask=None, status=Sample.Status.COMPLETED, **kw) -> Sample:
    prompt = [ord(c) for c in "Q?"]
    tokens = prompt + [ord(c) for c in response]
    n = len(response)
    return Sample(group_index=group, index=index, prompt="Q?", tokens=tokens, response=response, response_length=n,
                  reward=reward, loss_mask=mask if mask is not None else [1] * n,
                  rollout_log_probs=[-0.123456789 * (i + 1) for i in range(n)], status=status, **kw)


def test_compact_rollout_round_trip_drops_routed_experts_and_rounds_log_probs(tmp_path):
    s = _sample(0, 0, "ab", 1.0, rollout_routed_experts=[[[1, 2]]], weight_versions=["3"],
                weight_version_spans=[["3", 0, 2]])
    path = save_compact_rollout(tmp_path, "rollout_0", [[s]], max_mb=1)
    assert path == compact_rollout_path(tmp_path, "rollout_0") == tmp_path / "rollouts" / "rollout_0.jsonl.gz"
    [d] = read_compact_rollout(path)
    assert "rollout_routed_experts" not in d
    assert d["rollout_log_probs"] == [-0.12346, -0.24691]
    assert d["tokens"] == s.tokens and d["loss_mask"] == [1, 1] and d["weight_version_spans"] == [["3", 0, 2]]
    assert Sample.from_dict(d).response == "ab"  # still a valid sample


def test_size_cap_deletes_oldest_rollouts_and_never_keeps_one_over_it(tmp_path):
    big = _sample(0, 0, "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000)), 0.0)  # ~ incompressible
    sizes = []
    for rid in range(3):
        path = save_compact_rollout(tmp_path, f"rollout_{rid}", [[big]], max_mb=1)
        os.utime(path, (rid, rid))  # mtimes one second apart: the order is the rollout order
        sizes.append(path.stat().st_size)
    cap_mb = (sizes[0] * 2.5) / 2**20  # room for two files, not three
    save_compact_rollout(tmp_path, "rollout_3", [[big]], max_mb=cap_mb)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["rollout_2.jsonl.gz", "rollout_3.jsonl.gz"]
    assert save_compact_rollout(tmp_path, "rollout_4", [[big]], max_mb=sizes[0] / 2 / 2**20) is None
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["rollout_2.jsonl.gz", "rollout_3.jsonl.gz"]


def test_saving_flags_default_on_and_validated(arithmetic_data):
    base = ["--prompt-data", str(arithmetic_data[0]), "--rm-type", "math"]
    args = build_parser().parse_args(base)
    assert args.save_rollouts is True and args.save_rollouts_max_mb == 512.0
    assert build_parser().parse_args(base + ["--no-save-rollouts"]).save_rollouts is False
    with pytest.raises(ValueError, match="--save-rollouts-max-mb must be > 0"):
        validate_rollout_args(build_parser().parse_args(base + ["--save-rollouts-max-mb", "0"]))


def test_saving_flags_survive_the_run_config_round_trip(tmp_path):
    """<output-dir>/config.yaml reproduces a run that turned saving off (`train.py --config`)."""
    parser = build_parser()
    args = parser.parse_args(["--no-save-rollouts", "--save-rollouts-max-mb", "7"])
    path = write_resolved_config(args, tmp_path / "config.yaml", parser)
    again = parser.parse_args(config_to_argv(str(path), parser))
    assert (again.save_rollouts, again.save_rollouts_max_mb) == (False, 7.0)


def test_group_advantages_and_marked_tokens_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> +-1 (less the 1e-6 guard)
    adv = group_advantages([1.0, 0.0, None, 0.0, 1.0])
    assert adv[2] is None
    assert adv[0] == pytest.approx(0.5 / 0.500001) and adv[1] == pytest.approx(-0.5 / 0.500001)
    assert group_advantages([None, None]) == [None, None]
    assert group_advantages([2.0, 2.0]) == [0.0, 0.0]
    engine = [-0.1, -3.0, -0.5, -2.0, -9.0]
    mask = [1, 1, 1, 1, 0]
    assert marked_tokens(engine, None, mask, k=2) == [1, 3]  # least likely trained tokens; 4 is not trained
    trainer = [-0.1, -3.0, -0.9, -2.05, -1.0]
    assert marked_tokens(engine, trainer, mask, k=2) == [2, 3]  # largest |gap| 0.4, 0.05 among trained ones
    assert scalar_reward({"acc": 1, "fmt": 0.5}, "fmt") == 0.5 and scalar_reward(None, None) is None
    assert scalar_reward({"acc": 1}, None) is None and scalar_reward(float("nan"), None) is None


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_page_escapes_model_text_and_carries_the_numbers(tmp_path):
    evil = "<script>alert(1)</script>&"
    failed = _sample(2, 1, "xy", None, status=Sample.Status.FAILED, mask=[0, 0])
    failed.metadata["failure"] = {"stage": "reward", "reason": "timeout", "error": "<b>slow</b>"}
    groups = [[_sample(0, 0, evil, {"acc": 1.0, "fmt": 0.5}, mask=[1] * 10 + [0] * (len(evil) - 10),
                       metadata={"data_source": "<src>"}),
               _sample(1, 0, "ok", {"acc": 0.0, "fmt": 0.0})], [failed]]
    save_compact_rollout(tmp_path, "rollout_7", groups, max_mb=1)
    [path] = rollout_files(tmp_path)
    view = load_rollout_view(path, CharTokenizer(), "acc")
    page = rollout_page(view)
    assert "<script>alert" not in page and "<b>slow" not in page and "<src>" not in page
    assert ">&lt;</span>" in page and "&lt;b&gt;slow" in page and 'data-source="&lt;src&gt;"' in page
    tags = _Collect()
    tags.feed(page)
    sections = [a for t, a in tags.tags if t == "section"]
    assert [s["data-index"] for s in sections] == ["0", "1", "2"]
    assert [s["data-status"] for s in sections] == ["completed", "completed", "failed"]
    assert [s["data-source"] for s in sections] == ["<src>", "train", "train"]
    assert [s["data-reward"] for s in sections] == ["1.0", "0.0", ""]
    toks = [a for t, a in tags.tags if t == "span" and "tok" in a.get("class", "").split() and "data-i" in a]
    assert len(toks) == len(evil) + 2 + 2
    first = toks[:len(evil)]
    assert [("trained" in a["class"].split()) for a in first] == [True] * 10 + [False] * (len(evil) - 10)
    assert [float(a["data-lp"]) for a in first] == read_compact_rollout(path)[0]["rollout_log_probs"]
    assert "failed at <bdi>reward</bdi>: <b>timeout</b>" in page


def test_cli_writes_index_and_one_page_per_rollout(tmp_path, monkeypatch):
    for rid in (0, 1):
        save_compact_rollout(tmp_path, f"rollout_{rid}", [[_sample(rid, 0, "hi", 1.0)]], max_mb=1)
    save_compact_rollout(tmp_path, "eval_math_1", [[_sample(5, 0, "hey", 0.0)]], max_mb=1)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"rollout_id": 1, "eval/math/reward_mean": 0.0,
                                                        "rollout/reward_mean": 1.0}) + "\n")
    assert inspect_main([str(tmp_path)]) == 1  # no config.yaml naming the tokenizer
    (tmp_path / "config.yaml").write_text("hf-checkpoint: /nonexistent\n")
    monkeypatch.setattr("vime.utils.hf_tokenizer.load_tokenizer", lambda path: CharTokenizer())
    assert inspect_main([str(tmp_path)]) == 0
    out = tmp_path / "inspect"
    assert sorted(p.name for p in out.iterdir()) == ["eval_math_1.html", "index.html", "rollout_0.html",
                                                     "rollout_1.html"]
    index = (out / "index.html").read_text()
    assert index.index("rollout_0.html") < index.index("rollout_1.html") < index.index("eval_math_1.html")
    assert "rollout/reward_mean" in (out / "rollout_1.html").read_text()
    assert "rollout/reward_mean" not in (out / "eval_math_1.html").read_text()
    assert "eval/math/reward_mean" in (out / "eval_math_1.html").read_text()
    with gzip.open(tmp_path / "rollouts" / "rollout_0.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["response"] == "hi"


def test_page_chunks_by_response_tokens():
    assert page_chunks([3, 3, 3], 6) == [range(0, 2), range(2, 3)]
    assert page_chunks([10, 1, 1], 6) == [range(0, 1), range(1, 3)]  # a longer sample alone
    assert page_chunks([2, 2], 100) == [range(0, 2)] and page_chunks([], 5) == [range(0, 0)]


def test_cli_splits_a_large_rollout_over_linked_pages(tmp_path, monkeypatch):
    save_compact_rollout(tmp_path, "rollout_0", [[_sample(i, 0, "abcd", 1.0) for i in range(5)]], max_mb=1)
    (tmp_path / "config.yaml").write_text("hf-checkpoint: /nonexistent\n")
    monkeypatch.setattr("vime.utils.hf_tokenizer.load_tokenizer", lambda path: CharTokenizer())
    assert inspect_main([str(tmp_path), "--max-page-tokens", "8"]) == 0
    out = tmp_path / "inspect"
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "rollout_0.2.html", "rollout_0.3.html",
                                                     "rollout_0.html"]
    pages = [(out / f"{name}.html").read_text() for name in ("rollout_0", "rollout_0.2", "rollout_0.3")]
    assert [p.count('<section class="sample') for p in pages] == [2, 2, 1]
    assert 'href="rollout_0.3.html"' in pages[0] and 'href="rollout_0.html"' in pages[2]
    assert "page 2 of 3" in pages[1]
    assert "<td>5</td><td>0</td><td>1.0000</td><td>3</td>" in (out / "index.html").read_text()
