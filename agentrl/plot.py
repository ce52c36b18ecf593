"""`agentrl plot RUN`: reward and key metrics of a run, drawn to a PNG."""

from __future__ import annotations

from pathlib import Path

from agentrl.metrics_log import read_metrics

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "eval/reward_mean")),
    ("loss", ("loss", "pg_loss")),
    ("off-policy", ("off_policy/mismatch_kl", "staleness/mean")),
    ("entropy", ("entropy",)),
    ("throughput (tok/s)", ("rollout/tokens_per_s",)),
)


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
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=4, label=key)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(run_dir.name, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
