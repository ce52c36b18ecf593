"""The task stream's `rollout.skip_solved` filter: solved tasks leave the stream, and only they."""

from __future__ import annotations

import pytest

from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.task_stream import AllTasksSolved, SolvedTasks, TaskStream, solved_key
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import Group, Trajectory

TASKS = [{"id": f"t{i}"} for i in range(4)]


def test_a_task_leaves_the_stream_once_solved_enough_times() -> None:
    solved = SolvedTasks(2, 1.0, {}, TASKS)
    stream = solved.filter(TaskStream(TASKS, seed=0, shuffle=False).iterate())
    assert [next(stream)["id"] for _ in range(4)] == ["t0", "t1", "t2", "t3"]
    solved.record(TASKS[1], [1.0, 1.0])
    solved.record(TASKS[1], [1.0, 0.5])  # not every sample: not solved
    solved.record(TASKS[2], [1.0, 1.0])
    assert solved.solved() == 0 and [next(stream)["id"] for _ in range(4)] == ["t0", "t1", "t2", "t3"]
    solved.record(TASKS[1], [1.5, 1.0])  # the second solved group of t1
    assert solved.solved() == 1
    assert [next(stream)["id"] for _ in range(3)] == ["t0", "t2", "t3"] and solved.take_skipped() == 1
    assert solved.take_skipped() == 0


def test_when_every_task_is_solved_the_stream_says_so() -> None:
    solved = SolvedTasks(1, 1.0, {solved_key(t): 1 for t in TASKS[:3]}, TASKS)  # counts from the store
    stream = solved.filter(TaskStream(TASKS, seed=0, shuffle=False).iterate())
    assert next(stream)["id"] == "t3" and solved.skipped == 3
    solved.record(TASKS[3], [1.0])
    with pytest.raises(AllTasksSolved, match="all 4 training tasks were solved 1 time"):
        next(stream)


def test_mixture_members_keep_their_tasks_apart() -> None:
    a, b = {"id": "t0", "_env": "lake"}, {"id": "t0", "_env": "calculator"}
    solved = SolvedTasks(1, 1.0, {}, [a, b])
    solved.record(a, [1.0])
    assert solved_key(a) != solved_key(b) and solved.solved() == 1


def test_the_store_counts_solved_training_groups(tmp_path: object) -> None:
    def group(task: dict[str, object], rewards: list[float]) -> Group:
        trajs = [Trajectory(task_id=str(task["id"]), env="e", messages=[], token_ids=[], loss_mask=[], logprobs=[],
                            versions=[], reward=r, group_id="g", task=dict(task)) for r in rewards]  # fmt: skip
        g = Group(task_id=str(task["id"]), trajectories=trajs, task=dict(task))
        for t in trajs:
            t.group_id = g.id
        return g

    with TrajectoryStore(tmp_path / "s.sqlite") as store:  # type: ignore[operator]
        store.add_group(group(TASKS[0], [1.0, 1.0]), step=1, status="trained")
        store.add_group(group(TASKS[0], [1.0, 1.0]), step=2, status="dropped:dynamic_sampling")
        store.add_group(group(TASKS[1], [1.0, 0.0]), step=2, status="trained")
        store.add_group(group(TASKS[2], [1.0, 1.0]), step=2, status="dropped:error:env")
        store.add_group(group(TASKS[3], [float("nan"), 1.0]), step=2, status="trained")
        store.commit()
        assert store.solved_counts(1.0) == {"/t0": 2}
        assert store.solved_counts(0.0) == {"/t0": 2, "/t1": 1}


def test_skip_solved_settings_are_checked() -> None:
    assert RolloutConfig(skip_solved={"times": 2, "reward": 0.5}).skip_solved.times == 2  # type: ignore[union-attr]
    assert RolloutConfig().skip_solved is None
    with pytest.raises(ValueError, match="times"):
        RolloutConfig(skip_solved={"times": 0})
