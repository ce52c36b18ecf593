"""RunAlerts: when a run's metrics say it is going wrong, and only then."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.run.alerts import AlertsSection, RunAlerts

HEALTHY = {"off_policy/fresh_mismatch_kl": 2e-4, "rollout/episodes": 16.0, "rollout/errors/tool": 1.0}
DRIFTING = {"off_policy/fresh_mismatch_kl": 0.05, "rollout/episodes": 16.0}
FAILING = {"off_policy/fresh_mismatch_kl": 1e-4, "rollout/episodes": 10.0, "rollout/errors/sandbox": 4.0,
           "rollout/errors/timeout": 3.0}  # fmt: skip


def names(alerts: RunAlerts, metrics: dict[str, float]) -> list[str]:
    return [a.name for a in alerts.check(metrics)]


def test_engine_drift_fires_after_patience_steps_in_a_row_and_resets() -> None:
    alerts = RunAlerts(AlertsSection(patience=2))
    assert names(alerts, DRIFTING) == []  # one step may be a fluke
    fired = alerts.check(DRIFTING)
    assert [a.name for a in fired] == ["engine_drift"]
    assert "fresh_mismatch_kl=0.05 > 0.01" in fired[0].message and "2 steps in a row" in fired[0].message
    assert names(alerts, DRIFTING) == ["engine_drift"]  # keeps firing while it holds
    assert names(alerts, HEALTHY) == []
    assert names(alerts, DRIFTING) == []  # the streak started over


def test_episode_errors_count_every_error_class_against_the_episodes() -> None:
    alerts = RunAlerts(AlertsSection(patience=1, error_share=0.5))
    fired = alerts.check(FAILING)
    assert [a.name for a in fired] == ["episode_errors"]
    assert "70% of the step's episodes failed (7 of 10" in fired[0].message
    assert names(alerts, HEALTHY) == []  # 1 of 16
    assert names(alerts, {**FAILING, "rollout/errors/timeout": 1.0}) == []  # exactly half is not more than half


def test_missing_metrics_and_disabled_checks_never_fire() -> None:
    alerts = RunAlerts(AlertsSection(patience=1))
    # no fresh tokens in the step (all stale) and no episode finished: nothing can be told
    assert names(alerts, {"rollout/episodes": 0.0, "rollout/errors/env": 3.0}) == []
    off = RunAlerts(AlertsSection(patience=1, fresh_mismatch_kl=None, error_share=None))
    assert names(off, {**DRIFTING, **FAILING, "off_policy/fresh_mismatch_kl": 1.0}) == []


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValidationError, match="action"):
        AlertsSection.model_validate({"action": "panic"})
    with pytest.raises(ValidationError, match="error_share"):
        AlertsSection.model_validate({"error_share": 1.5})
    with pytest.raises(ValidationError, match="patience"):
        AlertsSection.model_validate({"patience": 0})


def test_nonfinite_grad_fires_on_skipped_updates() -> None:
    alerts = RunAlerts(AlertsSection(patience=1))
    fired = alerts.check({**HEALTHY, "optim/skipped_updates": 1.0})
    assert [a.name for a in fired] == ["nonfinite_grad"] and "NaN or inf" in fired[0].message
    assert names(alerts, {**HEALTHY, "optim/skipped_updates": 0.0}) == []
    assert names(RunAlerts(AlertsSection(patience=1, skipped_updates=None)), {"optim/skipped_updates": 4.0}) == []
    assert names(RunAlerts(AlertsSection(patience=1, skipped_updates=2)), {"optim/skipped_updates": 1.0}) == []


def test_replicas_lost_fires_while_the_pool_is_short_and_not_for_other_engines() -> None:
    alerts = RunAlerts(AlertsSection(patience=2))
    short = {**HEALTHY, "rollout/engine/replicas": 4.0, "rollout/engine/replicas_alive": 3.0,
             "rollout/engine/replicas_restarting": 1.0}  # fmt: skip
    assert names(alerts, short) == []  # one step: a restart in progress
    fired = alerts.check(short)
    assert [a.name for a in fired] == ["replicas_lost"] and "3 of 4 engine replicas alive (1 restarting)" in fired[0].message
    assert names(alerts, {**short, "rollout/engine/replicas_alive": 4.0}) == []  # replaced: the streak ends
    half = RunAlerts(AlertsSection(patience=1, replicas_alive_share=0.5))
    assert names(half, short) == [] and names(half, {**short, "rollout/engine/replicas_alive": 1.0}) == ["replicas_lost"]
    assert names(RunAlerts(AlertsSection(patience=1)), HEALTHY) == []  # an engine without a pool reports nothing
