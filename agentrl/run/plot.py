"""`agentrl plot RUN`: reward and key metrics of a run, drawn to a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.run.metrics_log import read_metrics

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "eval/reward_mean")),
    ("loss", ("loss", "pg_loss")),
    ("off-policy", ("off_policy/mismatch_kl", "staleness/mean")),
    ("entropy", ("entropy",)),
    ("throughput (tok/s)", ("rollout/tokens_per_s",)),
)


def held_out_by_minute(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(minutes since the run started, held-out reward) of every evaluation that has a wall time."""
    return [(r["time/wall_s"] / 60, r["eval/reward_mean"]) for r in rows
            if r.get("eval/reward_mean") is not None and r.get("time/wall_s") is not None]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the run's metrics.jsonl; returns the PNG path (RUN/curves.png by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"no metrics in {run_dir / 'metrics.jsonl'}")
    out = out or run_dir / "curves.png"
    panels = [(title, keys) for title, keys in PANELS if any(k in r for r in rows for k in keys)]
    timed = held_out_by_minute(rows)
    fig, axes = plt.subplots(len(panels) + bool(timed), 1, figsize=(7, 2.6 * (len(panels) + bool(timed))),
                             squeeze=False)
    for ax, (title, keys) in zip(axes[: len(panels), 0], panels, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=4, label=key)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("optimizer step")
    if timed:  # the same held-out points against wall clock: "learns within N minutes" is read here
        ax = axes[-1, 0]
        xs, ys = zip(*timed, strict=True)
        ax.plot(xs, ys, marker="o", ms=4, color="tab:orange", label="eval/reward_mean")
        ax.set_title("held-out reward vs wall clock", fontsize=10)
        ax.set_xlabel("minutes since the run started (model loading and evals included)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(run_dir.name, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
