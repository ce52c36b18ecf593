"""The overview's layout: the curves that matter first, the rest by prefix, constants on one line."""

from __future__ import annotations

import math

from agentrl.replay.overview import overview_layout


def _steps(n: int) -> list[dict[str, float]]:
    return [
        {"step": s, "count": 16, "reward_mean": 0.1 * s, "reward_min": 0.0, "reward_max": 1.0, "success_rate": 0.05 * s,
         "length_mean": 300.0 + s, "errors": 0, "truncated": s % 2}
        for s in range(1, n + 1)
    ]  # fmt: skip


def test_headline_order_and_what_it_draws() -> None:
    metrics = [(0, {"eval/reward_mean": 0.3, "eval/pass@1": 0.25})]
    for s in range(1, 5):
        metrics.append((s, {
            "reward/mean": 0.1 * s, "entropy": 1.0 / s, "off_policy/mismatch_kl": 1e-12 * s, "off_policy/ess": 1 - 0.01 * s,
            "staleness/mean": 0.5, "staleness/max": float(s % 2), "rollout/tokens_per_s": 10.0 + s,
            "time/tokens_per_s": 100.0 + s, "batch/sampled_tokens": 640.0 + s, "batch/trajectories": 16.0,
            "autocast_bf16": 0.0, "lr": 1e-4, "adv/mean": 0.01 * s, "loss": -0.1 * s, "alerts/engine_drift": math.nan,
        }))  # fmt: skip
    metrics.append((4, {**metrics[-1][1], "eval/reward_mean": 0.5, "eval/pass@1": 0.5}))
    del metrics[-2]
    layout = overview_layout(metrics, _steps(4))
    ids = [c["id"] for c in layout["headline"]]
    assert ids == ["reward", "success", "mismatch", "entropy", "length", "throughput", "staleness"]
    reward = layout["headline"][0]
    assert [s["key"] for s in reward["series"]] == ["reward/mean", "eval/reward_mean"]
    assert reward["series"][1]["points"] == [[0, 0.3], [4, 0.5]]  # held-out on the same axis
    assert reward["band"][0] == [1, 0.0, 1.0]
    success = layout["headline"][1]
    assert [s["key"] for s in success["series"]] == ["step:success_rate", "eval/pass@1"]
    assert layout["headline"][4]["series"][0]["points"][0] == [1, 641.0 / 16.0]
    staleness = layout["headline"][6]
    assert [s["key"] for s in staleness["series"]] == ["staleness/mean", "staleness/max"]
    # the rest: by prefix, the trajectories' own stats first, then top-level names; constants folded
    prefixes = [g["prefix"] for g in layout["groups"]]
    assert prefixes == ["trajectories", "step", "adv", "batch", "off_policy"]
    drawn = {c["id"] for g in layout["groups"] for c in g["charts"]} | {
        s["key"] for c in layout["headline"] for s in c["series"]
    }
    assert {"loss", "adv/mean", "off_policy/ess"} <= drawn
    constants = dict((k, v) for k, v in layout["constants"])
    assert constants == {
        "autocast_bf16": 0.0,
        "lr": 1e-4,
        "batch/trajectories": 16.0,
        "alerts/engine_drift": None,
    }
    assert not drawn & set(constants)


def test_a_run_without_metrics_still_opens_on_reward() -> None:
    layout = overview_layout([], _steps(3))
    assert layout["headline"][0]["id"] == "reward"
    assert layout["headline"][0]["series"][0]["points"] == [[1, 0.1], [2, 0.2], [3, 0.30000000000000004]]
    assert [c["id"] for c in layout["headline"]] == ["reward", "success"]
    assert overview_layout([], []) == {"headline": [], "groups": [], "constants": []}


def test_memory_chart_draws_rss_peak_and_each_parts_share() -> None:
    metrics = [
        (s, {"reward/mean": 0.1, "memory/rss_mb": 2000.0 + s, "memory/peak_rss_mb": 2500.0 + s,
             "memory/engine/prefix_cache_mb": 10.0 * s, "memory/trainer/optimizer_mb": 4.0,
             "memory/trimmed_mb": 5.0 * s})
        for s in range(1, 4)
    ]  # fmt: skip
    layout = overview_layout(metrics, [])
    memory = next(c for c in layout["headline"] if c["id"] == "memory")
    assert [s["key"] for s in memory["series"]] == [
        "memory/rss_mb", "memory/peak_rss_mb", "memory/engine/prefix_cache_mb", "memory/trainer/optimizer_mb",
    ]
    assert memory["series"][0]["points"] == [[1, 2001.0], [2, 2002.0], [3, 2003.0]]
    assert memory["series"][2]["label"] == "engine/prefix_cache_mb"
    # a share that never changes is still drawn in the chart, not folded into the constants
    assert "memory/trainer/optimizer_mb" not in dict(layout["constants"])
    assert [c["id"] for g in layout["groups"] for c in g["charts"]] == ["memory/trimmed_mb"]
