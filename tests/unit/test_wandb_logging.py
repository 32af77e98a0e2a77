"""--use-wandb: MetricsLogger writes an offline wandb run (no account, no network) that holds every rollout's
metrics and the reward curve; the --wandb-* flags are checked before anything starts."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError

from vime.arguments import parse_args
from vime.config.run import WandbConfig
from vime.utils.logging_utils import MetricsLogger
from vime.utils.resolved_config import plain_values

wandb = pytest.importorskip("wandb")

ROLLOUTS = [{"rollout/reward_mean": 0.25, "train/loss": 1.5}, {"rollout/reward_mean": 0.5, "train/loss": 1.25}]


def read_wandb_records(path: Path):
    """The protobuf records of a `.wandb` run file. wandb 0.31 has no Python reader (its Go core reads them), so
    this follows the format wandb documents for it: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
    LevelDB-log records (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks whose tail
    under 7 bytes is padding."""
    from wandb.proto import wandb_internal_pb2

    block, data = 32768, path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), "not a wandb run file of the known version"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def offline_history(wandb_dir: Path, timeout: float = 60.0) -> tuple[list[dict], object]:
    """The history rows and run record of the offline run under `wandb_dir`, once its exit record is written:
    wandb's core process writes the file on its own time, and on a loaded machine after `finish()` returned."""
    deadline = time.monotonic() + timeout
    while True:
        history, run, exited = [], None, False
        try:
            for run_file in wandb_dir.glob("wandb/offline-run-*/run-*.wandb"):
                for record in read_wandb_records(run_file):
                    kind = record.WhichOneof("record_type")
                    if kind == "history":
                        history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                        for item in record.history.item})
                    elif kind == "run":
                        run = record.run
                    exited |= kind == "exit"
        except DecodeError:  # a record still being written
            pass
        if exited or time.monotonic() > deadline:
            return history, run
        time.sleep(0.5)


def test_offline_run_holds_the_metrics_and_reward_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = parse_args([], validate=False)
    args.output_dir, args.use_wandb, args.wandb_mode = str(tmp_path / "out"), True, "offline"
    args.wandb_dir, args.wandb_group, args.wandb_run_name = str(tmp_path / "wandb"), "unit", "two-rollouts"
    logger = MetricsLogger(args.output_dir, WandbConfig.of(args), plain_values(args))
    for rollout_id, metrics in enumerate(ROLLOUTS):
        logger.log(rollout_id, metrics)
    logger.close()

    history, run = offline_history(tmp_path / "wandb")
    assert [row["_step"] for row in history] == [0, 1]
    for row, metrics in zip(history, ROLLOUTS):
        assert {k: row[k] for k in metrics} == metrics
    assert history[-1]["reward_curve/_type"] == "image-file"
    image = next((tmp_path / "wandb").glob("wandb/offline-run-*/files")) / history[-1]["reward_curve/path"]
    assert image.is_file() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run.project, run.run_group, run.display_name) == ("vime", "unit", "two-rollouts")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["wandb_mode"] == "offline" and config["output_dir"] == args.output_dir


def test_missing_wandb_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    args = parse_args([], validate=False)
    args.output_dir, args.use_wandb = str(tmp_path), True
    with pytest.raises(ImportError, match=r"pip install wandb==0\.31\.0"):
        MetricsLogger(args.output_dir, WandbConfig.of(args), plain_values(args))


def test_wandb_flags_need_use_wandb(tiny_qwen3, arithmetic_data, capsys, tmp_path):
    base = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math",
            "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        parse_args(base + ["--wandb-project", "p", "--wandb-mode", "offline"])
    assert "--wandb-project --wandb-mode only take effect with --use-wandb" in capsys.readouterr().err
    args = parse_args(base + ["--use-wandb", "--wandb-mode", "offline"])
    assert args.wandb_dir == str(tmp_path / "wandb") and args.wandb_project == "vime"
