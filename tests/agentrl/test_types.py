"""Core types: JSON round-trips are lossless, schema versions are checked, invariants hold."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trajectory_strategies import trajectories

from agentrl.types import SCHEMA_VERSION, Completion, Group, Trajectory


def same(a: Any, b: Any) -> bool:
    """Structural equality where NaN equals NaN and the sign of zero matters."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__slots__") and type(a) is type(b):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__slots__)
    return bool(a == b) and type(a) is type(b)


@settings(max_examples=150, deadline=None)
@given(traj=trajectories())
def test_trajectory_json_round_trip_is_lossless(traj: Trajectory) -> None:
    text = json.dumps(traj.to_dict(), allow_nan=False)  # strict JSON: no NaN/inf literals
    back = Trajectory.from_dict(json.loads(text))
    assert same(back, traj)


@settings(max_examples=40, deadline=None)
@given(trajs=st.lists(trajectories(), min_size=1, max_size=3))
def test_group_json_round_trip_is_lossless(trajs: list[Trajectory]) -> None:
    group = Group(task_id="t", trajectories=trajs, task={"id": "t", "x": [1, 2]})
    back = Group.from_dict(json.loads(json.dumps(group.to_dict(), allow_nan=False)))
    assert same(back, group)


def test_other_schema_versions_are_refused_clearly() -> None:
    traj = Trajectory(task_id="t", env="e", messages=[], token_ids=[], loss_mask=[], logprobs=[], versions=[])
    doc = traj.to_dict() | {"schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(ValueError, match="schema_version"):
        Trajectory.from_dict(doc)


def test_per_token_lists_must_align() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(task_id="t", env="e", messages=[], token_ids=[1, 2], loss_mask=[1], logprobs=[0.0, 0.0],
                   versions=[0, 0])  # fmt: skip
    with pytest.raises(ValueError, match="lengths differ"):
        Completion(ids=[2, 3], logprobs=[-0.1], versions=[0, 0], finish_reason="stop")


def test_tokens_give_the_trainer_exactly_the_sampled_view() -> None:
    traj = Trajectory(
        task_id="t", env="e", messages=[], token_ids=[5, 6, 7, 8, 9], loss_mask=[0, 0, 1, 1, 0],
        logprobs=[0.0, 0.0, -0.5, -1.5, 0.0], versions=[-1, -1, 3, 4, -1], reward=1.0, group_id="g",
    )  # fmt: skip
    sample = traj.tokens()
    assert sample.input_ids == [5, 6, 7, 8, 9] and sample.loss_mask == [0, 0, 1, 1, 0]
    assert sample.behaviour_logprobs[2:4] == [-0.5, -1.5] and sample.versions[2:4] == [3, 4]
    assert traj.policy_versions == (3, 4) and traj.num_sampled_tokens == 2
    assert sample.group_id == "g" and sample.trajectory_id == traj.id
