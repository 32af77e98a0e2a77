"""Multi-turn rollouts on the real stack: vLLM engine + vllm-router under Ray, `train.py --debug-rollout-only`.

A plugged-in generate function (`--custom-generate-function-path`, vime's code untouched) runs
`vime.agents.multi_turn.generate` with an environment that always answers, so every episode has exactly 3
model turns with environment output in between, whatever the random tiny model says.

"Trained tokens never change" is checked against two things outside the stored sequence:
1. the token ids vLLM returned for each model turn, recorded by the plugin from the HTTP answers and saved
   beside the sample (metadata["sampled_turn_ids"]): every loss_mask-1 token equals them, position by position;
2. a float32 transformers forward of the stored sequence: each trained token's log-prob under the model equals
   the log-prob vLLM reported for the token it sampled there, which could not hold for a different id.
Decoding the whole sequence and re-encoding it is also done; where that round trip yields other ids (a sampled
tokenization that is not the tokenizer's canonical one) a pipeline that re-tokenized would have trained on
tokens the model never sampled: the stored ids there are still the sampled ones (counted and reported).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.e2e.processes import stack_pids
from tests.helpers.browser import dump_dom, parse_page
from tests.helpers.trainer_runs import BASE_ARGV, launch
from vime.data.saved_rollouts import match_train_records, read_train_records
from vime.inspect.load import group_advantages, marked_tokens
from vime.inspect.render import inline_hash
from vime.rollout.debug_data import load_rollout, read_compact_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8
TURN_TOKENS = 16

PLUGIN = textwrap.dedent(f'''
    import contextvars

    from vime.agents import multi_turn
    from vime.rollout import generation

    _sampled = contextvars.ContextVar("sampled")

    async def _recording_post_generate(args, token_ids, params, **kwargs):
        choice = await generation.post_generate(args, token_ids, params, **kwargs)
        _sampled.get().append(list(choice.get("token_ids") or []))
        return choice

    multi_turn.post_generate = _recording_post_generate

    async def always_answer(args, sample, model_text, turn):
        return [{{"role": "tool", "content": f"observation {{turn}}: you wrote {{len(model_text)}} characters"}}]

    async def generate(args, sample, sampling_params):
        _sampled.set([])  # one list per sample: each generate call runs in its own asyncio task
        sample = await multi_turn.generate(args, sample, sampling_params, environment=always_answer,
                                           max_turns=3, max_turn_tokens={TURN_TOKENS})
        sample.metadata["sampled_turn_ids"] = _sampled.get()
        return sample
''')


@pytest.fixture(scope="module")
def episodes(tiny_qwen3, arithmetic_data, tmp_path_factory):
    assert not stack_pids(), "engine or router processes are already running"
    out = tmp_path_factory.mktemp("multi_turn_e2e")
    (out / "mt_plugin.py").write_text(PLUGIN)
    cmd = [
        sys.executable, str(REPO / "train.py"),
        "--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--debug-rollout-only",
        "--custom-generate-function-path", "mt_plugin.generate",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-num-gpus", "1", "--rollout-max-response-len", "200", "--rollout-temperature", str(TEMPERATURE),
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"), "--output-dir", str(out / "run"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "512",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(out), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    samples = [s for g in load_rollout(str(out / "rollout_{rollout_id}.jsonl"), 0) for s in g]
    return samples, stack_pids(), out


def test_three_model_turns_with_environment_turns_between(episodes):
    samples, *_ = episodes
    assert len(samples) == 8
    for s in samples:
        turns = s.metadata["turns"]
        assert [t["role"] for t in turns] == ["assistant", "environment"] * 2 + ["assistant"], s.metadata
        assert s.metadata["stop"] == "max_turns"
        # turns tile the response without gaps
        assert [t["start"] for t in turns] == [sum(t["length"] for t in turns[:i]) for i in range(len(turns))]
        assert sum(t["length"] for t in turns) == s.response_length == len(s.tokens) - s.prompt_length
        assert all(0 < t["length"] <= TURN_TOKENS for t in turns if t["role"] == "assistant")
        assert s.reward in (0.0, 1.0)


def test_masks_and_log_probs_align_with_tokens(episodes):
    samples, *_ = episodes
    for s in samples:
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        for t in s.metadata["turns"]:
            span = slice(t["start"], t["start"] + t["length"])
            if t["role"] == "assistant":
                assert s.loss_mask[span] == [1] * t["length"]
                assert all(lp < 0 for lp in s.rollout_log_probs[span])
            else:
                assert s.loss_mask[span] == [0] * t["length"]
                assert s.rollout_log_probs[span] == [0.0] * t["length"]


def test_trained_tokens_are_exactly_the_sampled_ones(episodes, tiny_qwen3):
    from transformers import AutoTokenizer

    samples, *_ = episodes
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    non_canonical = 0
    for s in samples:
        sampled = s.metadata["sampled_turn_ids"]
        model_turns = [t for t in s.metadata["turns"] if t["role"] == "assistant"]
        assert len(sampled) == len(model_turns) == 3
        response = s.response_tokens
        for turn, ids in zip(model_turns, sampled):
            assert response[turn["start"]:turn["start"] + turn["length"]] == ids
        trained = [tok for tok, m in zip(response, s.loss_mask) if m]
        assert trained == [tok for ids in sampled for tok in ids]
        # the decode -> re-encode round trip: text is preserved, ids may not be (counted, not trained on)
        text = tokenizer.decode(s.tokens, skip_special_tokens=False)
        reencoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(reencoded, skip_special_tokens=False) == text
        non_canonical += reencoded != s.tokens
    print(f"{non_canonical}/{len(samples)} sequences would change ids under decode->re-encode")


def test_engine_log_probs_match_transformers_on_stored_tokens(episodes, tiny_qwen3):
    from transformers import AutoModelForCausalLM

    samples, *_ = episodes
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    worst = 0.0
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        targets = torch.tensor(s.response_tokens)
        ref = logp[s.prompt_length - 1:len(s.tokens) - 1].gather(-1, targets[:, None]).squeeze(-1)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        gap = (ref - torch.tensor(s.rollout_log_probs))[mask].abs().max().item()
        worst = max(worst, gap)
    assert worst < 1e-4, f"max |vLLM - transformers| log-prob on trained tokens = {worst}"


def test_no_processes_left(episodes):
    _, left, _ = episodes
    assert not left, f"processes left after the run: {left}"


def test_inspector_page_in_a_browser_shows_the_saved_rollout(episodes, tiny_qwen3):
    """The run kept its rollout in <output-dir>/rollouts/ by default; `python -m vime.inspect` renders it, and the
    page as Chromium builds it (its script run) has one section per sample, shades exactly the loss-masked tokens,
    and carries the saved numbers: every engine log-prob, the reward, the group-normalised advantage."""
    samples, _, out = episodes
    run = out / "run"
    saved = read_compact_rollout(run / "rollouts" / "rollout_0.jsonl.gz")
    assert [d["tokens"] for d in saved] == [s.tokens for s in samples]  # the compact copy is the same rollout
    for d, s in zip(saved, samples):
        assert d["loss_mask"] == s.loss_mask and d["reward"] == s.reward
        assert d["rollout_log_probs"] == pytest.approx(s.rollout_log_probs, abs=5e-6)
    proc = subprocess.run([sys.executable, "-m", "vime.inspect", str(run)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = parse_page(dump_dom(run / "inspect" / "index.html"))
    assert [row[:2] for row in index.rows] == [["rollout_0", "8"]]

    page = parse_page(dump_dom(run / "inspect" / "rollout_0.html"))
    assert "8 of 8 samples shown" in page.text  # the page's script ran
    assert len(page.samples) == len(saved) == 8
    rewards = {}
    for d in saved:
        rewards.setdefault(d["group_index"], []).append(d["reward"])
    advantages = {g: iter(group_advantages(r)) for g, r in rewards.items()}
    assert "advantage (computed)" in page.text and "advantages (trainer)" not in page.text  # no trainer ran
    for section, d in zip(page.samples, saved):
        assert int(section.attrs["data-index"]) == d["index"] and section.attrs["data-status"] == d["status"]
        assert float(section.attrs["data-reward"]) == d["reward"]
        assert section.facts["advantage"] == f"{next(advantages[d['group_index']]):.4f}"
        assert all("data-train-lp" not in t for t in section.tokens)
        assert [int(t["data-i"]) for t in section.tokens] == list(range(d["response_length"]))
        assert [int("trained" in t["class"].split()) for t in section.tokens] == d["loss_mask"]
        assert [float(t["data-lp"]) for t in section.tokens] == d["rollout_log_probs"]
        assert 0 < sum(d["loss_mask"]) < d["response_length"]  # multi-turn: trained and untrained tokens both
        assert json.loads(section.attrs["data-spans"]) == d["weight_version_spans"] != []
        assert section.facts["weight"] == ", ".join(map(str, d["weight_versions"]))

    # hovering a token shows its log-prob and weight version (the page's script writes the title on mouseover); the
    # page's Content-Security-Policy runs only scripts it names by hash, so the hovering script goes in with its own
    hover = run / "inspect" / "hover.html"
    hovering = ("for (const t of document.querySelectorAll('span.tok[data-i]')) "
                "t.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));")
    hover.write_text((run / "inspect" / "rollout_0.html").read_text()
                     .replace("script-src ", f"script-src {inline_hash(hovering)} ", 1)
                     .replace("</body>", f"<script>{hovering}</script></body>"))
    hovered = parse_page(dump_dom(hover))
    for section, d in zip(hovered.samples, saved):
        for i, t in enumerate(section.tokens):
            versions = [v for v, start, end in d["weight_version_spans"] if start <= i < end]
            assert len(versions) == d["loss_mask"][i]  # the model's tokens have a version, the environment's none
            assert t["title"] == f"token {i} \u00b7 engine log-prob {d['rollout_log_probs'][i]:.5f}" + "".join(
                f" \u00b7 weight version {v}" for v in versions), t

    best = max(d["reward"] for d in saved)
    filtered = parse_page(dump_dom(run / "inspect" / "rollout_0.html", f"#min={best}&status=ok"))
    shown = [s for s in filtered.samples if "hidden" not in s.attrs]
    assert len(shown) == sum(d["reward"] >= best for d in saved)
    assert f"{len(shown)} of 8 samples shown" in filtered.text


def _groups(samples: list[dict]) -> list[list[dict]]:
    """Consecutive samples of one group_index together, as the rollout was saved."""
    groups: list[list[dict]] = []
    for d in samples:
        if groups and groups[-1][0]["group_index"] == d["group_index"]:
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def test_inspector_page_shows_the_trainers_log_probs_and_advantages(episodes, tiny_qwen3, tmp_path):
    """The run above generated only; a float32 CPU trainer (one rank) now trains on its saved rollout, in a copy of
    the run's folder, and keeps its records beside it. The page then shows the trainer's log-prob of every token,
    equal to the saved file's and within 1e-3 of the engine's on the trained tokens (the same weights, both float32),
    the largest gaps marked, and the trainer's GRPO advantages as "advantages (trainer)"."""
    _, _, out = episodes
    run = tmp_path / "run"
    shutil.copytree(out / "run", run, ignore=shutil.ignore_patterns("inspect"))
    saved = read_compact_rollout(run / "rollouts" / "rollout_0.jsonl.gz")
    argv = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, "--rollout-batch-size", "4", "--n-samples-per-prompt",
            "2", "--rollout-temperature", str(TEMPERATURE), "--save-rollouts", "--output-dir", str(run)]
    launch({"argv": argv, "data": {"0": _groups(saved)}, "train": [0]}, tmp_path / "ranks", timeout_s=300)
    records = match_train_records(saved, read_train_records(run / "rollouts", 0))
    assert all(r is not None and r["log_probs_from"] == "first_step" for r in records)
    worst = max(abs(t - e) for d, r in zip(saved, records)
                for t, e, m in zip(r["log_probs"], d["rollout_log_probs"], d["loss_mask"]) if m)
    assert worst < 1e-3, f"max |trainer - engine| log-prob on trained tokens = {worst}"

    proc = subprocess.run([sys.executable, "-m", "vime.inspect", str(run)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = parse_page(dump_dom(run / "inspect" / "rollout_0.html"))
    assert "8 of 8 samples shown" in page.text and "advantage (computed)" not in page.text
    for section, d, r in zip(page.samples, saved, records):
        assert [float(t["data-train-lp"]) for t in section.tokens] == r["log_probs"]
        marked = [int(t["data-i"]) for t in section.tokens if "marked" in t["class"].split()]
        assert marked == sorted(marked_tokens(d["rollout_log_probs"], r["log_probs"], d["loss_mask"]))
        trained = {a for a, m in zip(r["advantages"], d["loss_mask"]) if m}
        assert len(trained) == 1  # GRPO: one advantage per sample
        assert section.facts["advantages"] == f"{trained.pop():.4f}"
    print(f"max |trainer - engine| log-prob on trained tokens: {worst:.2e}")
