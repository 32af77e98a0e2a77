"""reward_curve.png: a valid PNG of rollout/reward_mean and every eval/*/reward_mean, with the plotted points
readable back from its text chunk."""

from __future__ import annotations

import json

from PIL import Image

from vime.utils.plot import SERIES_KEY, save_reward_curve


def test_png_holds_the_runs_points(tmp_path):
    rows = [{"rollout_id": 0, "rollout/reward_mean": 0.25, "eval/arith/reward_mean": 0.5},
            {"rollout_id": 1, "rollout/reward_mean": 0.75, "train/loss": 1.0},
            {"rollout_id": 2, "rollout/reward_mean": 0.5, "eval/arith/reward_mean": 0.625}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = save_reward_curve(tmp_path)
    assert path == tmp_path / "reward_curve.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()  # chunks and CRCs
    with Image.open(path) as image:
        assert image.size[0] > 100 and image.size[1] > 100
        series = json.loads(image.text[SERIES_KEY])
    assert series == {"eval/arith/reward_mean": [[0, 0.5], [2, 0.625]],
                      "rollout/reward_mean": [[0, 0.25], [1, 0.75], [2, 0.5]]}


def test_nothing_to_plot(tmp_path):
    assert save_reward_curve(tmp_path) is None  # no metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "train/loss": 1.0}) + "\n")
    assert save_reward_curve(tmp_path) is None and not (tmp_path / "reward_curve.png").exists()


def test_eval_pass_at_k_series_are_plotted(tmp_path):
    rows = [{"rollout_id": 0, "eval/arith/reward_mean": 0.5, "eval/arith/pass@1": 0.5, "eval/arith/pass@4": 0.75,
             "eval/arith/maj@4": 0.25, "eval/arith/mean@4": 0.5, "eval/arith/response_len_mean": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with Image.open(save_reward_curve(tmp_path)) as image:
        series = json.loads(image.text[SERIES_KEY])
    assert sorted(series) == ["eval/arith/maj@4", "eval/arith/mean@4", "eval/arith/pass@1", "eval/arith/pass@4",
                              "eval/arith/reward_mean"]
    assert series["eval/arith/pass@4"] == [[0, 0.75]]
