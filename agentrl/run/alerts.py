"""Run alerts: a few metrics that mean a run is going wrong, watched every step.

Four conditions are checked after each train step, on that step's metrics:

- `engine_drift`: `off_policy/fresh_mismatch_kl` (the KL between engine and
  trainer over the tokens the engine sampled with the very weights the
  trainer held: no staleness in it) is above `fresh_mismatch_kl`. On the same
  weights only numerics separate the two sides (dtype, kernels), so a value
  far above rounding means the engine is not serving what the trainer thinks
  (a broken weight sync, a sampling-parameter mismatch, a wrong dtype), the
  drift that precedes collapse in other frameworks' issue trackers.
- `episode_errors`: the share of the step's finished episodes that ended in
  an error (`rollout/errors/*` over `rollout/episodes`) is above
  `error_share`: the env, tools, sandbox or engine are failing more than they
  work.
- `nonfinite_grad`: the step skipped at least `skipped_updates` optimizer
  updates because the gradient norm was NaN or inf (`optim/skipped_updates`;
  the trainer never applies such an update). Once is an accident of one
  batch; every step means the loss itself is broken (a NaN reward, an
  overflow in low precision).
- `replicas_lost`: fewer than `replicas_alive_share` of an engine pool's
  replicas serve (`rollout/engine/replicas_alive` over `.../replicas`, the
  `ray` pool): dead replicas being replaced for longer than `patience`
  steps, or ones that ran out of restarts. The run goes on at lower
  throughput, which nothing else would say.

A condition fires when it held on `patience` consecutive steps. A firing is
logged in the step's metrics (`alerts/<name>` = 1) and printed; with
`action: stop` the run also writes a checkpoint and ends with an error that
names the alert (resume with `--resume` after fixing the cause).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AlertsSection(BaseModel):
    """Thresholds that stop (or flag) a run going wrong; null turns a check off."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["warn", "stop"] = Field(
        "warn", description="warn: print and log alerts/<name>; stop: also checkpoint and end the run"
    )
    patience: int = Field(2, ge=1, description="consecutive steps a condition must hold before it fires")
    fresh_mismatch_kl: float | None = Field(
        1e-2, gt=0,
        description="engine_drift when off_policy/fresh_mismatch_kl (engine vs trainer on the same weights) "
        "is above this (docs/metrics.md has measured values)",
    )  # fmt: skip
    error_share: float | None = Field(
        0.5, gt=0, le=1, description="episode_errors when more than this share of the step's episodes failed"
    )
    replicas_alive_share: float | None = Field(
        1.0, gt=0, le=1,
        description="replicas_lost when fewer than this share of an engine pool's replicas are alive "
        "(rollout/engine/replicas_alive over rollout/engine/replicas)",
    )  # fmt: skip
    skipped_updates: int | None = Field(
        1, ge=1,
        description="nonfinite_grad when a step skipped at least this many optimizer updates for a NaN/inf "
        "gradient norm (optim/skipped_updates)",
    )  # fmt: skip


@dataclass(frozen=True)
class Alert:
    """A condition that held for `patience` steps."""

    name: str
    message: str


class RunAlerts:
    """Checks one step's metrics against the thresholds; remembers how many steps in a row each held."""

    def __init__(self, config: AlertsSection) -> None:
        self.config = config
        self._streak: dict[str, int] = {}

    def check(self, metrics: Mapping[str, float]) -> list[Alert]:
        """The alerts that fire at this step (each keeps firing while its condition holds)."""
        fired = []
        for name, message in self._conditions(metrics).items():
            if message is None:
                self._streak.pop(name, None)
                continue
            self._streak[name] = streak = self._streak.get(name, 0) + 1
            if streak >= self.config.patience:
                fired.append(Alert(name, f"{message} ({streak} steps in a row)"))
        return fired

    def _conditions(self, m: Mapping[str, float]) -> dict[str, str | None]:
        """Per condition: why it holds at this step, or None (it does not, or cannot be told)."""
        cfg = self.config
        out: dict[str, str | None] = {}
        kl = m.get("off_policy/fresh_mismatch_kl")
        if cfg.fresh_mismatch_kl is not None and kl is not None:
            out["engine_drift"] = (
                f"off_policy/fresh_mismatch_kl={kl:.3g} > {cfg.fresh_mismatch_kl:g}: the engine's logprobs differ "
                "from the trainer's on the same weights (weight sync, dtype or sampling settings)"
                if kl > cfg.fresh_mismatch_kl else None
            )  # fmt: skip
        episodes = m.get("rollout/episodes", 0.0)
        if cfg.error_share is not None and episodes > 0:
            errors = sum(v for k, v in m.items() if k.startswith("rollout/errors/"))
            share = errors / episodes
            out["episode_errors"] = (
                f"{share:.0%} of the step's episodes failed ({errors:.0f} of {episodes:.0f}; see rollout/errors/*) "
                f"> error_share={cfg.error_share:g}"
                if share > cfg.error_share else None
            )  # fmt: skip
        alive, replicas = m.get("rollout/engine/replicas_alive"), m.get("rollout/engine/replicas")
        if cfg.replicas_alive_share is not None and alive is not None and replicas:
            out["replicas_lost"] = (
                f"{alive:.0f} of {replicas:.0f} engine replicas alive "
                f"({m.get('rollout/engine/replicas_restarting', 0.0):.0f} restarting) < replicas_alive_share="
                f"{cfg.replicas_alive_share:g}: the pool serves at reduced throughput"
                if alive / replicas < cfg.replicas_alive_share else None
            )  # fmt: skip
        skipped = m.get("optim/skipped_updates")
        if cfg.skipped_updates is not None and skipped is not None:
            out["nonfinite_grad"] = (
                f"optim/skipped_updates={skipped:.0f}: the gradient norm was NaN or inf, so the update was "
                "skipped (weights unchanged); look for non-finite rewards or advantages, or low-precision overflow"
                if skipped >= cfg.skipped_updates else None
            )  # fmt: skip
        return out
