"""Logging, metrics sinks (metrics.jsonl, TensorBoard, optional wandb) and progress bars."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

from vime.config.run import WandbConfig


# HTTP clients that log every request at INFO: thousands of lines a rollout on the console
QUIET_LOGGERS = ("httpx", "httpx2", "httpcore")  # httpx2: what the openai client uses


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))


def progress(iterable, desc: str, **kwargs):
    return tqdm(iterable, desc=desc, dynamic_ncols=True, disable=not sys.stderr.isatty() and
                os.environ.get("VIME_PROGRESS") != "1", **kwargs)


def start_wandb(wandb_flags: WandbConfig, output_dir: str, run_flags: dict):
    """A wandb run for --use-wandb: the --wandb-* flags, under `output_dir`/wandb unless --wandb-dir says
    elsewhere, with `run_flags` (the resolved flags, secrets left out: `resolved_config.plain_values`) as its config."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"--use-wandb needs wandb ({e}): pip install wandb==0.31.0") from e

    wandb_dir = Path(wandb_flags.wandb_dir or Path(output_dir) / "wandb")
    wandb_dir.mkdir(parents=True, exist_ok=True)
    # --wandb-key (slime's): to this process's wandb alone; never the environment, which every child inherits
    settings = wandb.Settings(api_key=wandb_flags.wandb_key) if wandb_flags.wandb_key else None
    return wandb.init(project=wandb_flags.wandb_project, group=wandb_flags.wandb_group, name=wandb_flags.wandb_run_name,
                      mode=wandb_flags.wandb_mode, dir=str(wandb_dir), config=run_flags, settings=settings)


def _row_rollout(line: str) -> int | None:
    """A metrics row's rollout id; None for a blank line or one a killed run left half written."""
    try:
        return json.loads(line)["rollout_id"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


class MetricsLogger:
    """One JSON object per log call in `<output_dir>/metrics.jsonl`, plus TensorBoard scalars and, with --use-wandb
    (`wandb`), the same metrics in wandb at step=rollout_id (and the reward curve when it closes); `run_flags` is
    the wandb run's config (`start_wandb`)."""

    def __init__(self, output_dir: str, wandb: WandbConfig = WandbConfig(), run_flags: dict | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time
            logging.getLogger(__name__).warning("tensorboard not installed; metrics go to metrics.jsonl only")
        self.wandb = start_wandb(wandb, output_dir, run_flags or {}) if wandb.use_wandb else None
        self.log_text = logging.getLogger("vime.metrics")

    def drop_rows_from(self, rollout_id: int) -> int:
        """Remove the rows of rollouts >= `rollout_id` (a resumed run redoes them; --overwrite-output starts over),
        keeping the earlier ones; returns how many went (logged)."""
        path = self.dir / "metrics.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if (row := _row_rollout(line)) is not None and row < rollout_id]
        if len(kept) == len(lines):
            return 0
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.jsonl.close()
        os.replace(tmp, path)  # whole or not at all
        self.jsonl = open(path, "a", encoding="utf-8")
        logging.getLogger(__name__).info("%s: %d rows of rollouts >= %d (or half written) from an earlier run "
                                         "removed", path, len(lines) - len(kept), rollout_id)
        return len(lines) - len(kept)

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        record = {"rollout_id": rollout_id, **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())  # on disk before the rollout's checkpoint is published
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, float(v), rollout_id)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: float(v) for k, v in metrics.items()}, step=rollout_id)
        shown = {k: round(float(v), 4) for k, v in metrics.items() if "reward" in k or k.endswith("time")}
        self.log_text.info("rollout %d: %s", rollout_id, shown)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            from vime.utils.plot import save_reward_curve

            curve = save_reward_curve(self.dir)
            if curve is not None:
                self.wandb.log({"reward_curve": wandb.Image(str(curve))})
            self.wandb.finish()
