"""Per-agent reward per rollout, from the rollouts a run saved (--save-debug-rollout-data DIR/rollouts/...).

    python -m examples.multi_agent.role_rewards outputs/multi_agent/grpo   # prints a table, writes role_rewards.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def role_rewards(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{role: [(rollout id, mean reward of that role's usable samples)]}."""
    series: dict[str, list[tuple[int, float]]] = {}
    files = sorted(Path(run_dir, "rollouts").glob("*.jsonl"), key=lambda p: int(p.stem))
    for path in files:
        per_role: dict[str, list[float]] = {}
        for line in path.read_text().splitlines():
            s = json.loads(line)
            if s["status"] in ("completed", "truncated") and s["reward"] is not None:
                per_role.setdefault(s["metadata"]["agent_role"], []).append(float(s["reward"]))
        for role, rewards in per_role.items():
            series.setdefault(role, []).append((int(path.stem), sum(rewards) / len(rewards)))
    return series


def main(run_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = role_rewards(run_dir)
    for role, points in series.items():
        print(f"{role:>8}: " + " ".join(f"{r:.2f}" for _, r in points))
    fig, ax = plt.subplots(figsize=(7, 4))
    for role, points in series.items():
        ax.plot(*zip(*points), marker="o", label=role)
    ax.set_xlabel("rollout")
    ax.set_ylabel("mean reward")
    ax.set_title("per-agent reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(run_dir, "role_rewards.png"), dpi=100)
    print(f"per-agent reward curve: {Path(run_dir, 'role_rewards.png')}")


if __name__ == "__main__":
    main(sys.argv[1])
