"""Replay queries over a store: filters against a Python reference, keyset pagination, full-text
search over the task question and the episode (not the prompt), groups, per-step stats, distinct values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries, fts_query
from agentrl.replay.synthetic import fill_store
from agentrl.store.summary import question
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
from agentrl.types import Trajectory


def canon(t: Trajectory) -> str:
    """A comparable form (NaN-safe: to_dict encodes non-finite floats as strings)."""
    return json.dumps(t.to_dict(), sort_keys=True)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Trajectory]]:
    path = tmp_path_factory.mktemp("synthetic") / STORE_FILENAME
    with TrajectoryStore(path) as store:
        groups = fill_store(store, steps=6, groups_per_step=5, group_size=4, seed=7)
        # a NaN reward must sort and paginate like any other value
        odd = groups[0].trajectories[0]
        nan_traj = Trajectory.from_dict({**odd.to_dict(), "id": "nan-reward", "reward": "nan"})
        store.add_trajectory(nan_traj, step=None, status="eval")
    trajs = [t for g in groups for t in g.trajectories]
    for i, g in enumerate(groups):
        STEPS.update({t.id: i // 5 + 1 for t in g.trajectories})
    STEPS[nan_traj.id] = None
    return path, [*trajs, nan_traj]


STEPS: dict[str, int | None] = {}  # trajectory id -> the step it was stored with (synthetic fixture)


def reference(trajs: list[Trajectory], f: TrajectoryFilter) -> set[str]:
    """The filter, evaluated in Python over the original trajectories.

    Tools and search look at the episode (the messages after the recorded prompt) and,
    for search, the task's question (the prompt's last message), never the demonstrations.
    """
    out = set()
    for t in trajs:
        step = STEPS[t.id]
        assert t.prompt_messages is not None
        episode = t.messages[t.prompt_messages :]
        tools = {c.name for m in episode for c in m.tool_calls}
        texts = [t.messages[t.prompt_messages - 1].content, *(m.content for m in episode)]
        checks = [
            f.step_min is None or (step is not None and step >= f.step_min),
            f.step_max is None or (step is not None and step <= f.step_max),
            f.env is None or t.env == f.env,
            f.reward_min is None or t.reward >= f.reward_min,
            f.reward_max is None or t.reward <= f.reward_max,
            f.error is None
            or (f.error == "none" and t.error is None)
            or (f.error == "any" and t.error is not None)
            or (t.error is not None and t.error.kind.value == f.error),
            f.truncated is None or t.truncated == f.truncated,
            f.tool is None or f.tool in tools,
            f.length_min is None or len(t.token_ids) >= f.length_min,
            f.length_max is None or len(t.token_ids) <= f.length_max,
            f.search is None or all(any(w in text for text in texts) for w in f.search.split()),
        ]
        if all(checks):
            out.add(t.id)
    return out


@pytest.mark.parametrize(
    "f",
    [
        TrajectoryFilter(),
        TrajectoryFilter(step_min=2, step_max=4),
        TrajectoryFilter(env="python_sandbox"),
        TrajectoryFilter(reward_min=1.0),
        TrajectoryFilter(reward_max=0.05, env="search_qa"),
        TrajectoryFilter(error="any"),
        TrajectoryFilter(error="none", truncated=False),
        TrajectoryFilter(error="tool"),
        TrajectoryFilter(truncated=True),
        TrajectoryFilter(tool="lookup"),
        TrajectoryFilter(tool="python", reward_min=1.0),
        TrajectoryFilter(tool="calculator"),  # every calculator prompt's demonstration calls it too
        TrajectoryFilter(length_min=600, length_max=900),
        TrajectoryFilter(search="ZeroDivisionError", truncated=False, step_min=2),
        TrajectoryFilter(search="Traceback ZeroDivisionError", reward_min=1.0, env="python_sandbox"),
    ],
)
def test_filters_match_a_python_reference(
    synthetic: tuple[Path, list[Trajectory]], f: TrajectoryFilter
) -> None:
    path, trajs = synthetic
    expected = reference(trajs, f)
    with TrajectoryQueries.open(path) as q:
        got = [r["id"] for r in q.query(f, limit=1000)]
        assert len(got) == len(set(got))
        assert set(got) == expected
        assert q.count(f) == len(expected)
    assert expected or f.error == "tool", "the synthetic run should exercise every filter"


@pytest.mark.parametrize(
    "order", ["newest", "oldest", "reward_desc", "reward_asc", "length_desc", "length_asc"]
)
def test_cursor_pagination_visits_every_row_once_in_order(
    synthetic: tuple[Path, list[Trajectory]], order: str
) -> None:
    path, trajs = synthetic
    with TrajectoryQueries.open(path) as q:
        seen: list[dict[str, Any]] = []
        cursor = None
        while True:
            items, cursor = q.page(order=order, limit=7, cursor=cursor)
            seen += items
            if cursor is None:
                break
        everything = q.query(order=order, limit=1000)
        by_offset = [r for off in range(0, len(trajs), 7) for r in q.query(order=order, limit=7, offset=off)]
    assert [r["id"] for r in seen] == [r["id"] for r in everything] == [r["id"] for r in by_offset]
    assert sorted(r["id"] for r in seen) == sorted(t.id for t in trajs)
    if order.startswith("reward"):
        finite = [r["reward"] for r in seen if r["reward"] is not None]
        assert finite == sorted(finite, reverse=order.endswith("desc"))
        assert any(r["reward"] is None for r in seen)  # the NaN reward is listed too
    if order == "newest":
        assert [r["seq"] for r in seen] == sorted((r["seq"] for r in seen), reverse=True)


def test_full_text_search(synthetic: tuple[Path, list[Trajectory]]) -> None:
    path, trajs = synthetic
    with TrajectoryQueries.open(path) as q:
        zero = {r["id"] for r in q.query(TrajectoryFilter(search="ZeroDivisionError"), limit=1000)}
        expected = {t.id for t in trajs if any("ZeroDivisionError" in m.content for m in t.messages)}
        assert zero == expected and zero
        # the demonstration in every calculator prompt is not searched; the task's question is
        assert sum("Demo question" in m.content for t in trajs for m in t.messages) >= 40
        assert q.count(TrajectoryFilter(search="Demo question")) == 0
        asked = question(trajs[0])
        assert asked and trajs[0].id in {r["id"] for r in q.query(TrajectoryFilter(search=asked), limit=1000)}
        # a word in a tool-call argument and a prefix query
        lookup = {r["id"] for r in q.query(TrajectoryFilter(search="plus"), limit=1000)}
        assert lookup == {t.id for t in trajs if any("plus" in m.content.split() or any(
            "plus" in json.dumps(c.arguments) for c in m.tool_calls) for m in t.messages)}  # fmt: skip
        prefix = q.count(TrajectoryFilter(search="ZeroDiv*"))
        assert prefix == len(expected)
        # FTS syntax in user input is taken literally, never an SQL/FTS error
        for nasty in ['"', "a OR", "NEAR(", "col:x", "-x", "*", "'; DROP TABLE trajectories; --"]:
            q.count(TrajectoryFilter(search=nasty))
        assert q.count() == len(trajs)
    assert fts_query('say "hi" now*') == '"say" AND """hi""" AND "now"*'


def test_filter_params_parse_and_errors_name_the_key() -> None:
    f = TrajectoryFilter.from_params(
        {"step_min": "2", "truncated": "true", "env": "calc", "reward_max": "", "x": "1"}
    )
    assert f == TrajectoryFilter(step_min=2, truncated=True, env="calc")
    with pytest.raises(ValueError, match="step_min='two'"):
        TrajectoryFilter.from_params({"step_min": "two"})
    with pytest.raises(ValueError, match=r"truncated='maybe'.*true/false"):
        TrajectoryFilter.from_params({"truncated": "maybe"})


def test_bad_query_arguments(synthetic: tuple[Path, list[Trajectory]]) -> None:
    path, _ = synthetic
    with TrajectoryQueries.open(path) as q:
        with pytest.raises(ValueError, match="order='sideways'"):
            q.query(order="sideways")
        with pytest.raises(ValueError, match="limit=0"):
            q.query(limit=0)
        with pytest.raises(ValueError, match="cursor="):
            q.page(cursor="garbage!")


def test_groups_metrics_and_cursors(synthetic: tuple[Path, list[Trajectory]]) -> None:
    path, trajs = synthetic
    with TrajectoryQueries.open(path) as q:
        members = q.group_members(trajs[5].group_id)
        assert [m["sample_index"] for m in members] == [0, 1, 2, 3]
        group = q.group(trajs[5].group_id)
        assert group is not None and group["size"] == 4
        rewards = [t.reward for t in trajs if t.group_id == trajs[5].group_id]
        assert group["reward_mean"] == pytest.approx(sum(rewards) / 4)
        metrics = q.store.metrics()
        assert [s for s, _ in metrics] == [1, 2, 3, 4, 5, 6]
        assert set(metrics[0][1]) == {"reward/mean", "loss/policy", "offpolicy/kl", "time/step_s"}
        assert q.store.cursors() == list(range(30))
        after = q.store.groups_after(4, status=None)
        assert [len(g.trajectories) for g in after] == [4] * 10
        original = {t.id: t for t in trajs}
        assert all(canon(t) == canon(original[t.id]) for g in after for t in g.trajectories)
        assert q.distinct("env") == ["calculator", "python_sandbox", "search_qa"]
        assert "lookup" in q.distinct("tool")
        rows = q.step_rewards()
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
        for row in rows:
            mine = [t for t in trajs if STEPS[t.id] == row["step"]]
            rewards = [t.reward for t in mine]
            assert row["count"] == len(mine) == 20
            assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
            assert (row["reward_min"], row["reward_max"]) == (min(rewards), max(rewards))
            assert row["length_mean"] == pytest.approx(sum(len(t.token_ids) for t in mine) / len(mine))
            assert row["errors"] == sum(t.error is not None for t in mine)
            assert row["truncated"] == sum(t.truncated for t in mine)
        assert q.distinct("error_class") == sorted({t.error.kind.value for t in trajs if t.error})
        assert q.distinct("status") == ["dropped", "eval", "trained"]


def test_moving_a_group_to_another_step_keeps_step_stats_exact(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        groups = fill_store(store, steps=3, groups_per_step=2, group_size=3, seed=11)
        moved = groups[0]  # stored at step 1
        store.set_group_step(moved.id, step=3)
        store.commit()
        q = TrajectoryQueries(store)
        assert {r["step"] for r in q.group_members(moved.id)} == {3}
        group = q.group(moved.id)
        assert group is not None and group["step"] == 3
        by_step: dict[int, list[Trajectory]] = {}
        for g, step in zip(groups, [1, 1, 2, 2, 3, 3], strict=True):
            by_step.setdefault(3 if g is moved else step, []).extend(g.trajectories)
        rows = q.step_rewards()
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            rewards = [t.reward for t in by_step[row["step"]]]
            assert row["count"] == len(rewards)
            assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
            assert (row["reward_min"], row["reward_max"]) == (min(rewards), max(rewards))
        assert q.count(TrajectoryFilter(step_min=3, step_max=3)) == 9
