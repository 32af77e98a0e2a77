"""The trainer's records of a rollout for the inspector (`vime.data.saved_rollouts`): their match to the saved
samples, the size cap they share with the rollouts, the inspector's page with and without them, and what real
training ranks write (two data-parallel ranks, each its share; the first step's log-probs equal the old log-probs a
two-step rollout computes)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.rollouts import flat, make_rollout
from tests.helpers.trainer_runs import BASE_ARGV, launch
from tests.unit.test_inspect import CharTokenizer, _Collect, _sample
from vime.data.saved_rollouts import (match_train_records, read_train_records, save_train_records, train_record,
                                      train_records_path)
from vime.inspect.load import COMPUTED_ADVANTAGES_NOTE, TRAINER_ADVANTAGES_NOTE, load_rollout_view
from vime.inspect.render import rollout_page
from vime.rollout.debug_data import compact_rollout_path, read_compact_rollout, save_compact_rollout


def _saved(*shape) -> list[dict]:
    """Sample dicts as a rollout saves them: (group_index, index, response_length) each."""
    return [{"group_index": g, "index": i, "response_length": n} for g, i, n in shape]


def _record(position, sample, n=None, log_probs=True):
    n = sample["response_length"] if n is None else n
    return train_record(position, {**sample, "response_length": n}, [-0.5] * n if log_probs else None, [1.0] * n,
                        "first_step" if log_probs else None)


def test_train_record_rounds_and_keeps_the_keys():
    r = train_record(3, {"group_index": 1, "index": 7, "response_length": 2, "tokens": [1, 2, 3]},
                     [-0.1234567, float("nan")], [0.9999999, -1.0], "old_log_probs")
    assert r == {"position": 3, "index": 7, "group_index": 1, "response_length": 2, "log_probs": [-0.12346, None],
                 "log_probs_from": "old_log_probs", "advantages": [1.0, -1.0]}
    assert train_record(0, {"response_length": 1}, None, None, None)["advantages"] is None  # SFT: no advantages


def test_match_by_position_then_by_group_and_index():
    samples = _saved((0, 0, 3), (0, 1, 4), (1, 2, 5))
    records = [_record(p, s) for p, s in enumerate(samples)]
    assert match_train_records(samples, records) == records
    # the saved copy reordered: the (group, index) key finds each, the position is not trusted
    reordered = [samples[2], samples[0], samples[1]]
    assert match_train_records(reordered, records) == [records[2], records[0], records[1]]
    # a record whose lengths disagree with the sample at its position and everywhere else matches nothing
    assert match_train_records(samples, [_record(0, samples[0], n=9)]) == [None, None, None]
    # a record for a sample the saved file does not hold (another rollout's) is dropped
    assert match_train_records(samples, [_record(5, {"group_index": 9, "index": 9, "response_length": 3})]) == \
        [None] * 3


def test_a_reused_sample_id_never_pairs_the_wrong_numbers():
    """Two samples with the same (group, index) and length (a custom rollout that reuses ids): the position decides;
    without a usable position the record is ambiguous and matches nothing."""
    samples = _saved((0, 0, 3), (0, 0, 3))
    first, second = _record(0, samples[0]), _record(1, samples[1])
    assert match_train_records(samples, [second, first]) == [first, second]
    lost = {**first, "position": 7}
    assert match_train_records(samples, [lost]) == [None, None]
    # and one record per sample: a second record for the same position is not laid over the first
    assert match_train_records(samples, [first, {**first, "advantages": [2.0] * 3}]) == [first, None]


def test_records_are_read_per_rollout_and_count_against_the_cap(tmp_path):
    s = _saved((0, 0, 2))[0]
    for rollout_id in (1, 10):
        for rank in (0, 1):
            save_train_records(tmp_path, rollout_id, rank, [_record(rank, s)], max_mb=1)
    rollouts = tmp_path / "rollouts"
    assert train_records_path(tmp_path, 1, 0) == rollouts / "rollout_1.train.0.jsonl.gz"
    assert len(read_train_records(rollouts, 1)) == 2 and len(read_train_records(rollouts, 10)) == 2  # not 1's
    assert read_train_records(rollouts, 2) == []
    assert {p.stat().st_mode & 0o777 for p in rollouts.iterdir()} == {0o600}  # private whatever the umask
    # one cap for the folder: a new rollout deletes the oldest files, the trainer's records among them
    sizes = sum(p.stat().st_size for p in rollouts.iterdir())
    big = _sample(0, 0, "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(2000)), 0.0)
    path = save_compact_rollout(tmp_path, "rollout_11", [[big]], max_mb=1)
    cap_mb = (path.stat().st_size + sizes / 2) / 2**20
    save_train_records(tmp_path, 11, 0, [_record(0, s)], max_mb=cap_mb)
    assert sum(p.stat().st_size for p in rollouts.iterdir()) <= cap_mb * 2**20
    assert (rollouts / "rollout_11.train.0.jsonl.gz").exists() and path.exists()
    assert save_train_records(tmp_path, 12, 0, [_record(0, s)], max_mb=1e-6) is None  # alone over the cap
    assert not (rollouts / "rollout_12.train.0.jsonl.gz").exists()


def _two_groups(tmp_path):
    groups = [[_sample(0, 0, "abc", 1.0), _sample(1, 0, "de", 0.0, mask=[1, 0])], [_sample(2, 1, "fg", 1.0)]]
    save_compact_rollout(tmp_path, "rollout_4", groups, max_mb=1)
    return read_compact_rollout(compact_rollout_path(tmp_path, "rollout_4"))


def test_page_without_trainer_records_shows_the_computed_advantages(tmp_path):
    """A --debug-rollout-only run saves no trainer records: the page is today's, group-normalised and labelled."""
    _two_groups(tmp_path)
    view = load_rollout_view(compact_rollout_path(tmp_path, "rollout_4"), CharTokenizer(), None)
    assert view.advantages_note == COMPUTED_ADVANTAGES_NOTE
    assert all(s.train_log_probs is None and s.train_advantages is None for s in view.samples)
    page = rollout_page(view)
    assert "advantage (computed)" in page and "advantages (trainer)" not in page and "data-train-lp" not in page


def test_page_with_trainer_records_shows_them_and_marks_the_largest_gaps_first(tmp_path):
    saved = _two_groups(tmp_path)
    engine = [d["rollout_log_probs"] for d in saved]
    trainer = [[lp + 0.01 * (k + 1) for k, lp in enumerate(e)] for e in engine]  # the gap grows along the sample
    trainer[0][1] = float("nan")  # a non-finite trainer log-prob: saved as null, marked first
    advantages = [[0.5] * 3, [-0.25, -0.75], [0.0, 0.0]]
    for rank, positions in enumerate([[0, 2], [1]]):  # two ranks, each its share
        save_train_records(tmp_path, 4, rank, [train_record(p, saved[p], trainer[p], advantages[p], "first_step")
                                               for p in positions], max_mb=1)
    view = load_rollout_view(compact_rollout_path(tmp_path, "rollout_4"), CharTokenizer(), None)
    assert view.advantages_note == TRAINER_ADVANTAGES_NOTE
    first, second, third = view.samples
    assert first.train_log_probs[0] == round(trainer[0][0], 5) and math.isnan(first.train_log_probs[1])
    assert first.marked == [1, 2, 0]  # NaN, then the largest gap first
    assert second.marked == [0]  # only its trained token
    assert third.train_advantages == [0.0, 0.0]
    page = rollout_page(view)
    tags = _Collect()
    tags.feed(page)
    toks = [a for t, a in tags.tags if t == "span" and "data-i" in a]
    assert [float(a["data-train-lp"]) for a in toks[3:5]] == [round(x, 5) for x in trainer[1]]
    assert [a.get("data-adv") for a in toks] == [None] * 3 + ["-0.25", "-0.75"] + [None] * 2  # only where it varies
    assert 'advantages (trainer): <b class="f-advantages">0.5000</b>' in page
    assert 'advantages (trainer): <b class="f-advantages">-0.2500</b>' in page  # the trained token's
    assert "advantage (computed)" not in page
    # a rollout the trainer saved half of: each sample says whose advantages it shows
    train_records_path(tmp_path, 4, 1).unlink()
    view = load_rollout_view(compact_rollout_path(tmp_path, "rollout_4"), CharTokenizer(), None)
    assert view.advantages_note.startswith("2 of 3 samples: ")
    assert view.samples[1].train_advantages is None and view.samples[1].advantage is not None


@pytest.fixture(scope="module")
def trained(tiny_qwen3, tmp_path_factory):
    """Rollout 0 trained by two data-parallel ranks in one step (log-probs from the step's own forward), by one rank
    in two steps (--global-batch-size 8 of 16 samples: the old log-probs are computed first), and by one rank with
    --no-save-rollouts; the three runs side by side (each is mostly process start-up)."""
    groups = make_rollout(seed=3)
    cases = {"one_step": (2, ["--save-rollouts"]), "two_steps": (1, ["--save-rollouts", "--global-batch-size", "8"]),
             "not_saved": (1, ["--no-save-rollouts"])}
    out = {name: tmp_path_factory.mktemp(name) for name in cases}
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = [pool.submit(launch, {"argv": ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *extra, "--output-dir",
                                              str(out[name])], "data": {"0": groups}, "train": [0]},
                            out[name] / "ranks", world_size=world_size)
                for name, (world_size, extra) in cases.items()]
        for run in runs:
            run.result()
    return groups, out


def test_each_rank_saves_its_share_and_every_sample_is_saved_once(trained):
    groups, runs = trained
    samples = flat(groups)
    files = sorted(p.name for p in (runs["one_step"] / "rollouts").iterdir())
    assert files == ["rollout_0.train.0.jsonl.gz", "rollout_0.train.1.jsonl.gz"]
    records = read_train_records(runs["one_step"] / "rollouts", 0)
    assert sorted(r["position"] for r in records) == list(range(len(samples)))
    matched = match_train_records(samples, records)
    assert all(r is not None for r in matched)
    for sample, r in zip(samples, matched):
        assert r["log_probs_from"] == "first_step" and len(r["log_probs"]) == sample["response_length"]
        assert all(lp < 0 for lp in r["log_probs"])
        # GRPO: one advantage per sample, of the sign of its reward against the group's mean
        group_mean = sum(s["reward"] for s in groups[sample["group_index"]]) / len(groups[sample["group_index"]])
        assert len(set(r["advantages"])) == 1 and math.copysign(1, r["advantages"][0]) == \
            math.copysign(1, sample["reward"] - group_mean)


def test_first_step_log_probs_equal_the_old_log_probs(trained):
    """Both are the trainer's log-probs under the weights the rollout was sampled with."""
    groups, runs = trained
    samples = flat(groups)
    one = match_train_records(samples, read_train_records(runs["one_step"] / "rollouts", 0))
    two = match_train_records(samples, read_train_records(runs["two_steps"] / "rollouts", 0))
    assert {r["log_probs_from"] for r in two} == {"old_log_probs"}
    worst = max(abs(a - b) for r1, r2 in zip(one, two) for a, b in zip(r1["log_probs"], r2["log_probs"]))
    assert worst <= 2e-5, worst  # the same numbers, each rounded to 1e-5
    assert [r["advantages"] for r in one] == [r["advantages"] for r in two]


def test_no_save_rollouts_saves_no_trainer_records(trained):
    _, runs = trained
    assert not (runs["not_saved"] / "rollouts").exists()
