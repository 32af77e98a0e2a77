"""The reward curve a person looks at after a run: rollout reward and eval reward per rollout, as a PNG. The
plotted points also ride in the PNG as a text chunk (`SERIES_KEY`, JSON {series: [[rollout, value], ...]}), so a
program (or a test) can read back exactly what the picture shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

SERIES_KEY = "vime reward series"
# each eval set's mean reward, and pass@k / mean@k / maj@k with --eval-pass-at-k
_EVAL_SERIES = re.compile(r"/(reward_mean|pass@\d+|mean@\d+|maj@\d+)$")


def save_reward_curve(output_dir: str | Path, name: str = "reward_curve.png") -> Path | None:
    """Plot `rollout/reward_mean`, every `eval/*/reward_mean` and `eval/*/pass@k`, `mean@k`, `maj@k` from
    metrics.jsonl; None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key == "rollout/reward_mean" or (key.startswith("eval/") and _EVAL_SERIES.search(key)):
                series.setdefault(key, []).append((record["rollout_id"], value))
    if not series:
        return None
    points = {key: sorted(series[key]) for key in sorted(series)}
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, xy in points.items():
        xs, ys = zip(*xy)
        ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, label=key)
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.set_title(f"vime: {output_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = output_dir / name
    fig.savefig(out, dpi=100, metadata={SERIES_KEY: json.dumps(points)})
    plt.close(fig)
    return out
