"""RolloutMetrics: bounded tool-name keys and a throughput that does not jump with bursts."""

from __future__ import annotations

from agentrl.rollout.metrics import MAX_TOOL_NAMES, RolloutMetrics
from agentrl.types import Trajectory, Turn


def _episode(names: list[str], sampled: int) -> Trajectory:
    ids = list(range(2 + sampled))
    mask = [0, 0] + [1] * sampled
    return Trajectory(
        task_id="t", env="e", messages=[], token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), versions=[-1, -1] + [0] * sampled,
        turns=[Turn(start=2, end=2 + sampled, tool_calls=names)],
    )


def test_model_invented_tool_names_share_one_key() -> None:
    m = RolloutMetrics()
    m.episode(_episode(["calculator", "calculator"], 3))
    m.episode(_episode([f"made_up_{i}" for i in range(40)], 3))
    out = m.take(queue_depth=0, in_flight=0)
    per_name = {k: v for k, v in out.items() if k.startswith("rollout/tool_calls/")}
    assert per_name["rollout/tool_calls/calculator"] == 2
    assert len(per_name) == MAX_TOOL_NAMES + 1  # 16 names, then everything else in _other
    assert per_name["rollout/tool_calls/_other"] == 40 - (MAX_TOOL_NAMES - 1)
    assert sum(per_name.values()) == 42


def test_throughput_is_the_run_average_and_the_window_rate_is_kept() -> None:
    m = RolloutMetrics()
    m.episode(_episode([], 10))
    first = m.take(queue_depth=0, in_flight=0)
    empty = m.take(queue_depth=0, in_flight=0)  # no episode finished in this window
    assert first["rollout/tokens_per_s"] > 0 and first["rollout/window_tokens_per_s"] > 0
    assert empty["rollout/window_tokens_per_s"] == 0.0
    assert 0 < empty["rollout/tokens_per_s"] <= first["rollout/tokens_per_s"]


def test_the_engines_own_counters_are_logged_under_rollout_engine() -> None:
    alive = [2.0]
    m = RolloutMetrics(engine_stats=lambda: {"replicas_alive": alive[0], "replica_restarts": 0})
    assert m.take(queue_depth=0, in_flight=0)["rollout/engine/replicas_alive"] == 2.0
    alive[0] = 1.0  # read at every take, not once
    out = m.take(queue_depth=0, in_flight=0)
    assert out["rollout/engine/replicas_alive"] == 1.0 and out["rollout/engine/replica_restarts"] == 0.0
    assert not any(k.startswith("rollout/engine/") for k in RolloutMetrics().take(queue_depth=0, in_flight=0))


def test_retokenization_drift_is_averaged_over_the_windows_episodes() -> None:
    m = RolloutMetrics()
    for drift in (0.0, 0.0, 0.1, 0.3):
        traj = _episode([], 4)
        traj.metrics["retokenization_drift"] = drift
        m.episode(traj)
    m.episode(_episode([], 4))  # no drift recorded (an episode that failed before its first turn): counts as 0
    out = m.take(queue_depth=0, in_flight=0)
    assert out["rollout/retokenization_drift_mean"] == (0.1 + 0.3) / 5
    assert out["rollout/retokenization_drift_max"] == 0.3
    assert out["rollout/retokenization_drift_share"] == 2 / 5
    empty = m.take(queue_depth=0, in_flight=0)  # a new window starts from nothing
    assert empty["rollout/retokenization_drift_mean"] == empty["rollout/retokenization_drift_max"] == 0.0
    assert empty["rollout/retokenization_drift_share"] == 0.0
