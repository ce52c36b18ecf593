"""Per-step rollout metrics: a window of counters the manager fills and `take()` empties.

Keys are flat `rollout/...` names (floats), ready for the store and loggers:
episodes/s, sampled tokens/s, turns, retokenization drift (how far re-rendering
the messages would be from the ids the model saw), tool calls per tool, errors by class,
groups dropped by reason, retries, the staleness histogram of groups handed to
the trainer, queue depth, in-flight episodes, the engine busy fraction and
the engine's own counters (`rollout/engine/<key>`, from an engine's optional
`stats()`, e.g. the ray pool's live and restarted replicas).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from agentrl.types import Group, Trajectory

MAX_TOOL_NAMES = 16
"""Distinct tool names that get their own `rollout/tool_calls/<name>` key; the model picks the
names, so the rest (misspellings, inventions) share `rollout/tool_calls/_other`."""


@runtime_checkable
class EngineBusy(Protocol):
    """An `InferenceEngine` that reports the seconds it spent generating (`rollout/engine_busy`)."""

    def busy_seconds(self) -> float: ...


@runtime_checkable
class EngineStats(Protocol):
    """An `InferenceEngine` with cheap counters of its own, logged as `rollout/engine/<key>`."""

    def stats(self) -> Mapping[str, float]: ...


class RolloutMetrics:
    """Counters since the last `take()`; cheap enough for every finished episode."""

    def __init__(
        self, busy_seconds: Callable[[], float] | None = None,
        engine_stats: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:  # fmt: skip
        self._busy_seconds = busy_seconds
        self._engine_stats = engine_stats
        self._started = time.monotonic()
        self._tokens_total = 0
        self._tool_names: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self._t0 = time.monotonic()
        self._busy0 = self._busy_seconds() if self._busy_seconds else 0.0
        self.episodes = 0
        self.tokens = 0
        self.turns = 0
        self.drift_sum = 0.0
        self.drifted = 0  # episodes whose ids a re-tokenising framework would have got wrong
        self.drift_max = 0.0
        self.tool_calls: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.retries = 0
        self.groups_out = 0
        self.reward_sum = 0.0

    def episode(self, traj: Trajectory) -> None:
        sampled = traj.num_sampled_tokens  # a pass over the episode's tokens: once
        self.episodes += 1
        self.tokens += sampled
        self.turns += len(traj.turns)
        self._tokens_total += sampled
        drift = traj.metrics.get("retokenization_drift", 0.0)
        if drift:
            self.drift_sum += drift
            self.drifted += 1
            if drift > self.drift_max:
                self.drift_max = drift
        for turn in traj.turns:
            for name in turn.tool_calls or ():
                if name not in self._tool_names and len(self._tool_names) < MAX_TOOL_NAMES:
                    self._tool_names.add(name)
                self.tool_calls[name if name in self._tool_names else "_other"] += 1
        if traj.error is not None:
            self.errors[traj.error.kind.value] += 1

    def handed_over(self, group: Group, staleness: int) -> None:
        self.groups_out += 1
        self.staleness[staleness] += 1
        self.reward_sum += sum(group.rewards) / max(1, len(group.trajectories))

    def take(self, *, queue_depth: int, in_flight: int) -> dict[str, float]:
        """The window's metrics; starts a new window."""
        now = time.monotonic()
        wall = max(now - self._t0, 1e-9)
        out: dict[str, float] = {
            "rollout/episodes": float(self.episodes),
            "rollout/episodes_per_s": self.episodes / wall,
            # episodes finish in bursts, so a window's rate jumps; the run average is what to watch
            "rollout/tokens_per_s": self._tokens_total / max(now - self._started, 1e-9),
            "rollout/window_tokens_per_s": self.tokens / wall,
            "rollout/turns_mean": self.turns / self.episodes if self.episodes else 0.0,
            "rollout/retokenization_drift_mean": self.drift_sum / self.episodes if self.episodes else 0.0,
            "rollout/retokenization_drift_max": self.drift_max,
            "rollout/retokenization_drift_share": self.drifted / self.episodes if self.episodes else 0.0,
            "rollout/retries": float(self.retries),
            "rollout/groups": float(self.groups_out),
            "rollout/queue_depth": float(queue_depth),
            "rollout/in_flight": float(in_flight),
        }
        if self._busy_seconds is not None:
            out["rollout/engine_busy"] = min(1.0, (self._busy_seconds() - self._busy0) / wall)
        if self._engine_stats is not None:
            for key, value in self._engine_stats().items():
                out[f"rollout/engine/{key}"] = float(value)
        for name, n in self.tool_calls.items():
            out[f"rollout/tool_calls/{name}"] = float(n)
        for kind, n in self.errors.items():
            out[f"rollout/errors/{kind}"] = float(n)
        for why, n in self.dropped.items():
            out[f"rollout/dropped/{why}"] = float(n)
        for lag, n in sorted(self.staleness.items()):
            out[f"rollout/staleness/{lag}"] = float(n)
        if self.groups_out:
            out["rollout/reward_mean"] = self.reward_sum / self.groups_out
        self._reset()
        return out
