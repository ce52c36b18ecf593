"""The run overview's layout: the curves a user opens the page for first, then the rest.

`overview_layout` turns the per-step metrics and the store's per-step stats
into what the page draws, in order:

1. headline charts, each with one or more series on the same axis: training
   reward with held-out reward, success rate with held-out pass@1, the
   engine/trainer mismatch KL, entropy, response length, tokens/s, staleness,
   process memory (RSS after each step and its peak, with the engine's and
   the trainer's own shares, `memory/engine/*` and `memory/trainer/*`, on the same MiB axis);
2. every other metric, grouped by prefix (`adv/`, `off_policy/`, ...), a
   chart per metric that changes;
3. one line of the metrics that never change (a flat chart says nothing).

A multi-policy run (`policies:`) logs each policy's metrics as
`policy/<name>/<key>` and its held-out scores as `eval/policy/<name>/<key>`:
those are drawn one series per policy on shared charts (each policy keeps its
colour on every chart): held-out win rate and training reward per policy right
after the reward chart, the other keys in the `policy` group. A run without
them draws exactly what it drew before.

Metric names that have moved between versions are looked up by their
candidates in order (the first one present is drawn).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Points = list[list[float | None]]  # [[step, value or None], ...]
Layout = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a headline chart: a label and the metric names that may hold it."""

    label: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Headline:
    id: str
    title: str
    series: tuple[Series, ...]


HEADLINES = (
    Headline("reward", "reward: training vs held-out",
             (Series("training", ("reward/mean",)), Series("held-out", ("eval/reward_mean",)))),
    Headline("success", "success rate: training vs held-out pass@1",
             (Series("training", ("step:success_rate",)), Series("held-out", ("eval/pass@1",)))),
    Headline("mismatch", "engine vs trainer mismatch KL",
             (Series("all tokens", ("off_policy/mismatch_kl",)),
              Series("fresh tokens", ("off_policy/fresh_mismatch_kl",)))),
    Headline("entropy", "policy entropy (nats per sampled token)", (Series("entropy", ("entropy",)),)),
    Headline("length", "response length (sampled tokens per trajectory)",
             (Series("mean", ("step:sampled_per_trajectory",)),)),
    Headline("throughput", "tokens/s: generation vs trainer",
             (Series("generation", ("rollout/tokens_per_s",)), Series("trainer", ("time/tokens_per_s",)))),
    Headline("staleness", "staleness (policy versions behind)",
             (Series("mean", ("staleness/mean", "off_policy/staleness_mean", "rollout/staleness_mean")),
              Series("max", ("staleness/max", "off_policy/staleness_max")))),
    Headline("memory", "process memory (MiB): RSS after the step, peak, and the parts' own shares",
             (Series("rss", ("memory/rss_mb",)), Series("peak", ("memory/peak_rss_mb",)))),
)  # fmt: skip

SHARES = ("memory/engine/", "memory/trainer/")
"""Prefixes of the parts' own memory shares: drawn as extra lines of the memory chart."""

TOP_LEVEL = "step"

POLICY_METRIC = re.compile(r"^(eval/)?policy/([A-Za-z][A-Za-z0-9_-]{0,63})/(.+)$")
"""A per-policy metric: `policy/<name>/<key>` (training) or `eval/policy/<name>/<key>` (held-out)."""
POLICY_GROUP = "policy"
POLICY_HEADLINES = (  # (chart id, title, pattern: `*` stands for each policy's name)
    ("policy-win-rate", "held-out win rate per policy", "eval/policy/*/win_rate"),
    ("policy-reward", "training reward per policy", "policy/*/reward/mean"),
)
"""Per-policy headline charts, shown right after the reward chart."""
"""The group of metric names without a prefix (loss, grad_norm, lr, ...)."""


def overview_layout(
    metrics: Sequence[tuple[int, Mapping[str, float]]], steps: Sequence[Mapping[str, Any]]
) -> Layout:
    """What the overview draws (see the module docstring), as JSON-ready data.

    `metrics` is `TrajectoryStore.metrics()`, `steps` is `TrajectoryQueries.step_rewards()`.
    """
    table = _series_table(metrics, steps)
    per_policy = _policy_series(table)
    used: set[str] = {k for series in per_policy.values() for k in series.values()}
    headline = []
    for h in HEADLINES:
        series = []
        for s in h.series:
            key = next((k for k in s.keys if table.get(k)), None)
            if key is not None:
                series.append({"label": s.label, "key": key, "points": table[key]})
                used.add(key)
        if h.id == "memory" and series:
            for key in sorted(k for k in table if k.startswith(SHARES)):
                series.append({"label": key.removeprefix("memory/"), "key": key, "points": table[key]})
                used.add(key)
        if series:
            chart: Layout = {"id": h.id, "title": h.title, "series": series}
            if h.id == "reward":
                chart["band"] = [[s["step"], s["reward_min"], s["reward_max"]] for s in steps
                                 if s["reward_min"] is not None]  # fmt: skip
            headline.append(chart)
    names = sorted({name for series in per_policy.values() for name in series})
    shared = {pattern: _per_policy(pattern, series, table, names) for pattern, series in per_policy.items()}
    at = 1 if headline and headline[0]["id"] == "reward" else 0
    headline[at:at] = [shared.pop(pattern) | {"id": id, "title": title}
                       for id, title, pattern in POLICY_HEADLINES if pattern in shared]  # fmt: skip
    groups: dict[str, list[Layout]] = {}
    constants: list[list[Any]] = []
    for pattern in sorted(shared):
        chart = shared[pattern]
        if all(len({p[1] for p in s["points"] if p[1] is not None}) <= 1 for s in chart["series"]):
            constants.extend([s["key"], next((p[1] for p in s["points"] if p[1] is not None), None)]
                             for s in chart["series"])  # fmt: skip
        else:
            groups.setdefault(POLICY_GROUP, []).append(chart)
    stored = [("step:length_mean", "stored trajectories: length (mean tokens, prompt included)"),
              ("step:errors_truncations", "stored trajectories: errors + truncations")]  # fmt: skip
    for key, title in stored:
        if table.get(key):
            groups.setdefault("trajectories", []).append(_single(key, title, table[key]))
    for key in sorted(k for k in table if not k.startswith("step:") and k not in used):
        points = table[key]
        finite = {p[1] for p in points if p[1] is not None}
        if len(finite) <= 1:
            constants.append([key, next(iter(finite), None)])
            continue
        prefix = key.split("/", 1)[0] if "/" in key else TOP_LEVEL
        groups.setdefault(prefix, []).append(_single(key, key, points))
    order = sorted(groups, key=lambda p: (p != "trajectories", p != TOP_LEVEL, p != POLICY_GROUP, p))
    return {
        "headline": headline,
        "groups": [{"prefix": p, "charts": groups[p]} for p in order],
        "constants": constants,
    }


def _policy_series(table: Mapping[str, Points]) -> dict[str, dict[str, str]]:
    """Per-policy metrics by pattern (`policy/*/loss`, `eval/policy/*/win_rate`): policy name -> metric name."""
    out: dict[str, dict[str, str]] = {}
    for key in table:
        m = POLICY_METRIC.match(key)
        if m:
            evaluation, name, rest = m.groups()
            out.setdefault(f"{evaluation or ''}policy/*/{rest}", {})[name] = key
    return out


def _per_policy(
    pattern: str, series: Mapping[str, str], table: Mapping[str, Points], names: Sequence[str]
) -> Layout:
    """A shared chart with one series per policy; `colour` is the policy's place among all of the run's."""
    return {
        "id": pattern,
        "title": pattern,
        "series": [{"label": name, "key": series[name], "points": table[series[name]], "colour": names.index(name),
                    "policy": name} for name in names if name in series],
    }  # fmt: skip


def _single(key: str, title: str, points: Points) -> Layout:
    return {"id": key, "title": title, "series": [{"label": key, "key": key, "points": points}]}


def _series_table(
    metrics: Sequence[tuple[int, Mapping[str, float]]], steps: Sequence[Mapping[str, Any]]
) -> dict[str, Points]:
    """Metric name -> [[step, value or None], ...], plus derived `step:*` series."""
    table: dict[str, Points] = {}
    for step, values in metrics:
        for key, value in values.items():
            table.setdefault(key, []).append([step, value if math.isfinite(value) else None])
        sampled, trajectories = values.get("batch/sampled_tokens"), values.get("batch/trajectories")
        if sampled is not None and trajectories:
            table.setdefault("step:sampled_per_trajectory", []).append([step, sampled / trajectories])
    if "reward/mean" not in table and steps:  # runs that log no metrics: the stored trajectories' mean
        table["reward/mean"] = [[s["step"], s["reward_mean"]] for s in steps]
    for s in steps:
        table.setdefault("step:success_rate", []).append([s["step"], s["success_rate"]])
        table.setdefault("step:length_mean", []).append([s["step"], s["length_mean"]])
        table.setdefault("step:errors_truncations", []).append([s["step"], s["errors"] + s["truncated"]])
    return {k: v for k, v in table.items() if any(p[1] is not None for p in v) or not k.startswith("step:")}
