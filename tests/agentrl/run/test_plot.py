"""`agentrl plot`: the PNG and the held-out-reward-vs-wall-clock series it draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.run.plot import held_out_by_minute, plot_run


def _write(run: Path, rows: list[dict[str, float]]) -> None:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_held_out_points_are_placed_by_wall_clock(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "eval/reward_mean": 0.25, "time/wall_s": 90.0},
        {"step": 1, "reward/mean": 0.5, "time/wall_s": 150.0},
        {"step": 2, "reward/mean": 0.6, "eval/reward_mean": 0.5, "time/wall_s": 600.0},
        {"step": 3, "eval/reward_mean": 0.7},  # no wall time (an older run): left out
    ]
    assert held_out_by_minute(rows) == [(1.5, 0.25), (10.0, 0.5)]
    _write(tmp_path / "run", rows)
    png = plot_run(tmp_path / "run")
    assert png == tmp_path / "run" / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_metrics_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path / "empty", [])
    with pytest.raises(FileNotFoundError, match="no metrics"):
        plot_run(tmp_path / "empty")
