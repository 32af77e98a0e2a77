"""Prompt files (JSONL, Parquet, bad rows), the data source (epochs, shuffle, resume) and Sample round trips."""

from __future__ import annotations

import json
import tracemalloc
from types import SimpleNamespace

import pytest

from vime.data import prompt_dataset
from vime.data.data_source import RolloutDataSource
from vime.data.prompt_dataset import DataFormatError, load_prompt_file, load_prompt_samples
from vime.data.sample import Sample
from vime.rollout.debug_data import load_rollout, save_rollout


def _args(**kw):
    base = dict(input_key="prompt", label_key="label", metadata_key="metadata", tool_key=None,
                apply_chat_template=False, apply_chat_template_kwargs=None, rollout_max_prompt_len=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _write(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_become_prompt_samples(tmp_path, tokenizer):
    path = _write(tmp_path, ['{"prompt": "What is 1 + 2?", "label": "3", "metadata": {"src": "t"}}', "",
                             '{"prompt": "What is 2 + 2?", "label": "4"}'])
    samples = load_prompt_samples(path, tokenizer, _args())
    assert [s.label for s in samples] == ["3", "4"]
    assert samples[0].metadata == {"src": "t"} and samples[1].metadata == {}
    assert samples[0].tokens == tokenizer("What is 1 + 2?", add_special_tokens=False)["input_ids"]
    assert samples[0].response_length == 0 and samples[0].prompt_length == len(samples[0].tokens)


def test_chat_template_and_message_prompts(tmp_path, tokenizer):
    path = _write(tmp_path, [json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}], "label": "x"}),
                             json.dumps({"prompt": "plain", "label": "y"})])
    samples = load_prompt_samples(path, tokenizer, _args(apply_chat_template=True))
    assert samples[0].prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                                "<|im_start|>assistant\n"
    assert samples[1].prompt.startswith("<|im_start|>user\nplain<|im_end|>")


BAD_ROWS = [
    ('{"prompt": "a", "label": "1"', "p.jsonl:2: not valid JSON"),
    ('["a", "b"]', "p.jsonl:2: expected a JSON object"),
    ('{"question": "a", "label": "1"}', "p.jsonl:2: missing key 'prompt' (--input-key)"),
    ('{"prompt": "a"}', "p.jsonl:2: missing key 'label' (--label-key)"),
    ('{"prompt": "a", "label": "1", "metadata": [1]}', "p.jsonl:2: 'metadata' must be a dict"),
    ('{"prompt": [{"content": "x"}], "label": "1"}', "p.jsonl:2: each chat message needs 'role'"),
    ('{"prompt": [], "label": "1"}', "p.jsonl:2: prompt must be a string or a non-empty list"),
    ("[" * 5000 + "]" * 5000, "p.jsonl:2: JSON nested too deep to parse"),  # json.loads: RecursionError
]


@pytest.mark.parametrize("line, message", BAD_ROWS)
def test_bad_rows_are_skipped_naming_file_and_line(tmp_path, tokenizer, line, message, caplog):
    good = [json.dumps({"prompt": f"ok {i}", "label": str(i)}) for i in range(9)]
    path = _write(tmp_path, good[:1] + [line] + good[1:])  # 1 bad row of 10: within the 0.1 tolerance
    loaded = load_prompt_file(path, tokenizer, _args(apply_chat_template=True))
    assert [s.label for s in loaded.samples] == [str(i) for i in range(9)]
    assert len(loaded.skipped) == 1 and message in loaded.skipped[0]
    assert message in caplog.text  # the warning names file:line and the reason


@pytest.mark.parametrize("line, message", BAD_ROWS)
def test_too_many_bad_rows_is_an_error(tmp_path, tokenizer, line, message):
    path = _write(tmp_path, ['{"prompt": "ok", "label": "0"}', line])  # 1 bad row of 2 > 0.1
    with pytest.raises(DataFormatError, match="1 of 2 rows are malformed, more than --max-bad-prompt-rows-ratio") as e:
        load_prompt_samples(path, tokenizer, _args(apply_chat_template=True))
    assert message in str(e.value)
    loaded = load_prompt_file(path, tokenizer, _args(apply_chat_template=True, max_bad_prompt_rows_ratio=0.5))
    assert len(loaded.samples) == 1 and len(loaded.skipped) == 1


def test_all_rows_bad_is_an_error_even_with_full_tolerance(tmp_path, tokenizer):
    path = _write(tmp_path, ['{"question": "a", "label": "1"}', '{"question": "b", "label": "2"}'])
    with pytest.raises(DataFormatError, match="all 2 rows are malformed .*--input-key") as e:
        load_prompt_samples(path, tokenizer, _args(max_bad_prompt_rows_ratio=1.0))
    assert "p.jsonl:1: missing key 'prompt'" in str(e.value) and "p.jsonl:2:" in str(e.value)


def test_max_prompt_len_filters_and_counts(tmp_path, tokenizer):
    path = _write(tmp_path, ['{"prompt": "short", "label": "1"}',
                             json.dumps({"prompt": "long " * 50, "label": "2"})])
    loaded = load_prompt_file(path, tokenizer, _args(rollout_max_prompt_len=10))
    assert [s.label for s in loaded.samples] == ["1"] and loaded.too_long == 1 and loaded.skipped == []
    with pytest.raises(DataFormatError, match="no usable prompts"):
        load_prompt_samples(path, tokenizer, _args(rollout_max_prompt_len=1))


def test_an_over_long_line_is_a_bad_row_and_never_read_whole(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_dataset, "MAX_ROW_BYTES", 2**20)
    good = [json.dumps({"prompt": f"ok {i}", "label": str(i)}) for i in range(9)]
    huge = json.dumps({"prompt": "x" * (16 * 2**20), "label": "9"})  # valid JSON: only its length is wrong
    path = _write(tmp_path, good[:4] + [huge] + good[4:])
    tracemalloc.start()
    try:
        rows = list(prompt_dataset.read_rows(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a few times the 1 MiB limit (read buffers); reading the 16 MiB line whole holds it as bytes, text and JSON
    assert peak < 8 * 2**20, f"reading held {peak} bytes at once"
    assert [n for n, row in rows if isinstance(row, DataFormatError)] == [5] and len(rows) == 10
    loaded = load_prompt_file(path, tokenizer, _args())  # 1 bad row of 10: within the 0.1 tolerance
    assert [s.label for s in loaded.samples] == [str(i) for i in range(9)]
    assert loaded.skipped == [f"{path}:5: the line is over {2**20} bytes, far more than a prompt row; not read "
                              "(a wrong file, or rows that lost their newlines?)"]
    path = _write(tmp_path, good[:1] + [huge], name="q.jsonl")
    with pytest.raises(DataFormatError, match="1 of 2 rows are malformed, more than --max-bad-prompt-rows-ratio"):
        load_prompt_file(path, tokenizer, _args())


def test_a_line_of_exactly_the_limit_is_read(tmp_path, monkeypatch):
    row = json.dumps({"prompt": "p", "label": "1"})
    monkeypatch.setattr(prompt_dataset, "MAX_ROW_BYTES", len(row))
    path = tmp_path / "p.jsonl"
    path.write_text(f"{row}\n{row}")  # the last line without its newline
    assert [row for _, row in prompt_dataset.read_rows(path)] == [{"prompt": "p", "label": "1"}] * 2


class TokenizerSpy:
    """The real tokenizer, recording the length of each text it tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_an_over_long_prompt_is_dropped_before_it_is_tokenized(tmp_path, tokenizer):
    spy = TokenizerSpy(tokenizer)
    path = _write(tmp_path, ['{"prompt": "short", "label": "1"}', json.dumps({"prompt": "long " * 100_000,
                                                                             "label": "2"})])
    loaded = load_prompt_file(path, spy, _args(rollout_max_prompt_len=10))
    assert [s.label for s in loaded.samples] == ["1"] and loaded.too_long == 1 and loaded.skipped == []
    assert spy.lengths == [len("short")]  # the long one never reached the tokenizer


@pytest.mark.parametrize("text", ["short", "long " * 300, " " * 5000, "\u00e9\u4e2d" * 500, "<|im_start|>" * 200,
                                  "".join(chr(c) for c in range(32, 3000))])
def test_the_character_bound_never_drops_a_prompt_that_fits(tokenizer, text):
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(text) <= prompt_dataset.prompt_char_bound(tokenizer, tokens)


def test_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a b", "c"], "answer": ["1", "2"],
                             "metadata": [json.dumps({"k": 1}), None]}), path)
    samples = load_prompt_samples(path, tokenizer, _args(input_key="question", label_key="answer"))
    assert [s.label for s in samples] == ["1", "2"] and samples[0].metadata == {"k": 1}


def _prompts(n):
    return [Sample(prompt=f"p{i}", tokens=[i + 1], label=str(i)) for i in range(n)]


def test_data_source_groups_epochs_and_unique_indices():
    source = RolloutDataSource(_prompts(5), n_samples_per_prompt=3, seed=0, shuffle=False)
    groups = source.get_samples(4) + source.get_samples(4)
    assert [g[0].prompt for g in groups] == ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "p2"]
    assert source.epoch == 1
    indices = [s.index for g in groups for s in g]
    assert indices == list(range(24))
    assert all(len({s.group_index for s in g}) == 1 for g in groups)
    groups[0][0].tokens.append(99)  # copies, not the stored prompt
    assert source.prompts[0].tokens == [1]


def test_shuffle_is_seeded_and_differs_by_epoch():
    order = lambda seed: [g[0].prompt for g in RolloutDataSource(_prompts(8), 1, seed, True).get_samples(16)]
    assert order(3) == order(3) and order(3) != order(4)
    first, second = order(3)[:8], order(3)[8:]
    assert sorted(first) == sorted(second) and first != second


def test_data_source_resumes_same_order():
    a = RolloutDataSource(_prompts(6), 2, seed=1, shuffle=True)
    a.get_samples(4)
    a.add_samples([[Sample(prompt="returned", tokens=[1], index=100, group_index=50)]])
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON, as in a checkpoint
    b = RolloutDataSource(_prompts(6), 2, seed=1, shuffle=True)
    b.load_state_dict(state)
    ga, gb = a.get_samples(5), b.get_samples(5)
    assert [[s.to_dict() for s in g] for g in ga] == [[s.to_dict() for s in g] for g in gb]
    assert ga[0][0].prompt == "returned"


def test_sample_round_trip_is_lossless():
    s = Sample(group_index=1, index=7, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2, 3, 4],
               response="x", response_length=2, label={"a": [1, 2]}, reward={"score": 1.0, "acc": 0},
               loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.25], status=Sample.Status.TRUNCATED,
               metadata={"turns": 2}, weight_versions=[1, 2], tools=[{"name": "calc"}])
    d = json.loads(json.dumps(s.to_dict()))
    assert Sample.from_dict(d) == s
    assert s.prompt_length == 2 and s.response_tokens == [3, 4]
    assert s.get_reward_value(key="score") == 1.0
    with pytest.raises(ValueError, match="--reward-key"):
        s.get_reward_value()
    with pytest.raises(ValueError, match="unknown fields"):
        Sample.from_dict({**d, "bogus": 1})


def test_debug_rollout_files_round_trip(tmp_path):
    groups = [[Sample(group_index=g, index=g * 2 + i, tokens=[1, 2], response_length=1, reward=float(i),
                      status=Sample.Status.COMPLETED) for i in range(2)] for g in range(3)]
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    path = save_rollout(template, 4, groups)
    assert path.name == "r_4.jsonl" and len(path.read_text().splitlines()) == 6
    assert load_rollout(template, 4) == groups
    with pytest.raises(FileNotFoundError, match="r_5.jsonl"):
        load_rollout(template, 5)
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match="r_4.jsonl:7"):
        load_rollout(template, 4)


def test_bad_utf8_is_a_counted_bad_row_not_rewritten_text(tmp_path, tokenizer):
    good = [json.dumps({"prompt": f"ok {i} é", "label": str(i)}, ensure_ascii=False).encode() for i in range(9)]
    bad = b'{"prompt": "caf\xe9 latin-1", "label": "9"}'
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(good[:4] + [bad] + good[4:]) + b"\n")
    loaded = load_prompt_file(path, tokenizer, _args())
    assert [s.label for s in loaded.samples] == [str(i) for i in range(9)]
    assert all("\ufffd" not in s.prompt for s in loaded.samples)
    assert loaded.skipped == [f"{path}:5: not valid UTF-8 (byte 0xe9 at offset 15)"]
