"""TrajectoryStore: lossless round trip, filters and pagination, batching, crash safety, export."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trajectory_strategies import trajectories

from agentrl.replay.synthetic import fill_store
from agentrl.store import (
    STORE_FILENAME,
    TrajectoryFilter,
    TrajectoryStore,
    decode_array,
    encode_array,
    fts_query,
)
from agentrl.types import Group, Message, Trajectory


def canon(t: Trajectory) -> str:
    """A comparable form (NaN-safe: to_dict encodes non-finite floats as strings)."""
    return json.dumps(t.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    ("values", "kind", "code"),
    [
        ([], "int", "B"),
        ([0, 1, 1, 0], "int", "B"),
        ([-1, 5], "int", "b"),
        ([0, 49151], "int", "H"),
        ([-1, 40000], "int", "i"),
        ([2**40], "int", "q"),
        ([-0.5, -1.25, 0.0], "float", "f"),
        ([-0.1], "float", "d"),
    ],
)
def test_arrays_are_compact_and_exact(values: list[Any], kind: str, code: str) -> None:
    blob = encode_array(values, kind)  # type: ignore[arg-type]
    assert chr(blob[0]) == code
    assert decode_array(blob) == values


def test_float_arrays_keep_nan_inf_and_signed_zero_bits() -> None:
    values = [math.inf, -math.inf, -0.0, 1e-310, 3.4e38, 1e300]
    out = decode_array(encode_array(values, "float"))
    assert [math.copysign(1, x) for x in out] == [math.copysign(1, x) for x in values]
    assert out == values
    assert math.isnan(decode_array(encode_array([math.nan], "float"))[0])


def test_int_array_out_of_range_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="out of int64 range"):
        encode_array([2**64], "int")


# ----------------------------------------------------------------------------- round trip

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trajs=st.lists(trajectories(), min_size=1, max_size=4))
def test_round_trip_is_lossless(tmp_path: Path, trajs: list[Trajectory]) -> None:
    path = tmp_path / f"rt-{time.monotonic_ns()}.sqlite"
    with TrajectoryStore(path, commit_every=3) as store:
        for i, t in enumerate(trajs):
            store.add_trajectory(t, step=i, status="trained")
    with TrajectoryStore(path, readonly=True) as store:
        for t in trajs:
            assert canon(store.get_trajectory(t.id)) == canon(t)
        assert [r.trajectory.id for r in store.iter_records(batch_size=2)] == [t.id for t in trajs]


def test_realistic_round_trip_and_summaries(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        groups = fill_store(store, steps=3, groups_per_step=3, group_size=4, seed=1)
    assert (tmp_path / STORE_FILENAME).is_file()
    with TrajectoryStore(tmp_path, readonly=True) as store:
        assert store.count() == 36
        for g in groups:
            for t in g.trajectories:
                rec = store.get_record(t.id)
                assert canon(rec.trajectory) == canon(t)
                assert rec.trajectory.tokens() == t.tokens()
        t = groups[4].trajectories[2]
        row = store.query(TrajectoryFilter(group_id=t.group_id), order="oldest")[2]
        assert row["id"] == t.id
        assert row["num_tokens"] == len(t.token_ids)
        assert row["num_sampled"] == sum(t.loss_mask)
        assert row["tools"] == sorted({c.name for m in t.messages for c in m.tool_calls})
        assert row["num_turns"] == sum(m.role == "assistant" for m in t.messages)
        assert row["error_class"] == (t.error.kind.value if t.error else None)
        with pytest.raises(KeyError, match="nope"):
            store.get_trajectory("nope")


def test_duplicate_id_is_refused(tmp_path: Path) -> None:
    t = Trajectory(task_id="t", env="e", messages=[], token_ids=[], loss_mask=[], logprobs=[], versions=[])
    with TrajectoryStore(tmp_path) as store:
        store.add_trajectory(t, step=0, status="trained")
        with pytest.raises(ValueError, match="already in"):
            store.add_trajectory(t, step=0, status="trained")


# ----------------------------------------------------------------------------- queries


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
    """The filter, evaluated in Python over the original trajectories."""
    out = set()
    for t in trajs:
        step = STEPS[t.id]
        tools = {c.name for m in t.messages for c in m.tool_calls}
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
            f.search is None or all(any(w in m.content for m in t.messages) for w in f.search.split()),
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
    with TrajectoryStore(path, readonly=True) as store:
        got = [r["id"] for r in store.query(f, limit=1000)]
        assert len(got) == len(set(got))
        assert set(got) == expected
        assert store.count(f) == len(expected)
    assert expected or f.error == "tool", "the synthetic run should exercise every filter"


@pytest.mark.parametrize(
    "order", ["newest", "oldest", "reward_desc", "reward_asc", "length_desc", "length_asc"]
)
def test_cursor_pagination_visits_every_row_once_in_order(
    synthetic: tuple[Path, list[Trajectory]], order: str
) -> None:
    path, trajs = synthetic
    with TrajectoryStore(path, readonly=True) as store:
        seen: list[dict[str, Any]] = []
        cursor = None
        while True:
            items, cursor = store.page(order=order, limit=7, cursor=cursor)
            seen += items
            if cursor is None:
                break
        everything = store.query(order=order, limit=1000)
        by_offset = [
            r for off in range(0, len(trajs), 7) for r in store.query(order=order, limit=7, offset=off)
        ]
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
    with TrajectoryStore(path, readonly=True) as store:
        zero = {r["id"] for r in store.query(TrajectoryFilter(search="ZeroDivisionError"), limit=1000)}
        expected = {t.id for t in trajs if any("ZeroDivisionError" in m.content for m in t.messages)}
        assert zero == expected and zero
        # a word in a tool-call argument and a prefix query
        lookup = {r["id"] for r in store.query(TrajectoryFilter(search="plus"), limit=1000)}
        assert lookup == {t.id for t in trajs if any("plus" in m.content.split() or any(
            "plus" in json.dumps(c.arguments) for c in m.tool_calls) for m in t.messages)}  # fmt: skip
        prefix = store.count(TrajectoryFilter(search="ZeroDiv*"))
        assert prefix == len(expected)
        # FTS syntax in user input is taken literally, never an SQL/FTS error
        for nasty in ['"', "a OR", "NEAR(", "col:x", "-x", "*", "'; DROP TABLE trajectories; --"]:
            store.count(TrajectoryFilter(search=nasty))
        assert store.count() == len(trajs)
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
    with TrajectoryStore(path, readonly=True) as store:
        with pytest.raises(ValueError, match="order='sideways'"):
            store.query(order="sideways")
        with pytest.raises(ValueError, match="limit=0"):
            store.query(limit=0)
        with pytest.raises(ValueError, match="cursor="):
            store.page(cursor="garbage!")


def test_groups_metrics_and_cursors(synthetic: tuple[Path, list[Trajectory]]) -> None:
    path, trajs = synthetic
    with TrajectoryStore(path, readonly=True) as store:
        members = store.group_members(trajs[5].group_id)
        assert [m["sample_index"] for m in members] == [0, 1, 2, 3]
        group = store.group(trajs[5].group_id)
        assert group is not None and group["size"] == 4
        rewards = [t.reward for t in trajs if t.group_id == trajs[5].group_id]
        assert group["reward_mean"] == pytest.approx(sum(rewards) / 4)
        metrics = store.metrics()
        assert [s for s, _ in metrics] == [1, 2, 3, 4, 5, 6]
        assert set(metrics[0][1]) == {"reward/mean", "loss/policy", "offpolicy/kl", "time/step_s"}
        assert store.cursors() == list(range(30))
        after = store.groups_after(4, status=None)
        assert [len(g.trajectories) for g in after] == [4] * 10
        original = {t.id: t for t in trajs}
        assert all(canon(t) == canon(original[t.id]) for g in after for t in g.trajectories)
        assert store.distinct("env") == ["calculator", "python_sandbox", "search_qa"]
        assert "lookup" in store.distinct("tool")
        rows = store.step_rewards()
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
        assert store.distinct("error_class") == sorted({t.error.kind.value for t in trajs if t.error})
        assert store.distinct("status") == ["dropped", "eval", "trained"]


def test_metrics_keep_last_value_and_nan(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        store.add_metrics(3, {"a": 1.0, "b": math.nan})
        store.add_metrics(3, {"a": 2.0})
        store.add_metrics(1, {"a": -math.inf})
        got = store.metrics()
    assert got[0] == (1, {"a": -math.inf})
    assert got[1][0] == 3 and got[1][1]["a"] == 2.0 and math.isnan(got[1][1]["b"])


# ----------------------------------------------------------------------------- batching, readers, state


def _traj(i: int) -> Trajectory:
    return Trajectory(task_id=f"t{i}", env="e", messages=[Message("user", f"q{i}")], token_ids=[i, 1],
                      loss_mask=[0, 1], logprobs=[0.0, -0.5], versions=[-1, 0], id=f"traj-{i}")  # fmt: skip


def test_batches_commit_every_n_and_state_commits_with_them(tmp_path: Path) -> None:
    writer = TrajectoryStore(tmp_path, commit_every=4, commit_interval_s=3600)
    reader = TrajectoryStore(tmp_path, readonly=True)
    try:
        for i in range(3):
            writer.add_trajectory(_traj(i), step=1, status="trained")
        writer.set_state("cursor", {"position": 3})
        assert reader.count() == 0 and reader.get_state("cursor") is None  # nothing committed yet
        assert writer.get_state("cursor") == {"position": 3}  # the writer sees its own batch
        writer.add_trajectory(_traj(3), step=1, status="trained")  # 4th: the batch commits
        assert reader.count() == 4 and reader.get_state("cursor") == {"position": 3}
        assert writer.committed_trajectories == 4
        writer.add_trajectory(_traj(4), step=2, status="trained")
        assert reader.count() == 4
        writer.commit()
        assert reader.count() == 5
    finally:
        writer.close()
        reader.close()


def test_commit_interval(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path, commit_every=1000, commit_interval_s=0.0) as writer:
        writer.add_trajectory(_traj(0), step=1, status="trained")
        with TrajectoryStore(tmp_path, readonly=True) as reader:
            assert reader.count() == 1


def test_readonly_refuses_writes_and_missing_files(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as w:
        w.add_trajectory(_traj(0), step=1, status="trained")
    with TrajectoryStore(tmp_path, readonly=True) as r:
        for write in (
            lambda: r.add_trajectory(_traj(1), step=1, status="trained"),
            lambda: r.set_state("k", 1),
            lambda: r.add_metrics(1, {"a": 1.0}),
            lambda: r.set_run_config({}),
            lambda: r.add_group(Group(task_id="t", trajectories=[]), step=1),
        ):
            with pytest.raises(PermissionError, match="read-only"):
                write()
        # even raw SQL cannot write through the read-only connection
        with pytest.raises(sqlite3.OperationalError):
            r._db.execute("DELETE FROM trajectories")
        assert r.count() == 1
    with pytest.raises(FileNotFoundError, match="no trajectory store"):
        TrajectoryStore(tmp_path / "missing", readonly=True)


def test_foreign_or_newer_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ValueError, match="not an agentrl trajectory store"):
        TrajectoryStore(junk, readonly=True)
    with TrajectoryStore(tmp_path / "a.sqlite") as store:
        store._db.execute("UPDATE meta SET value='99' WHERE key='store_schema_version'")
    with pytest.raises(ValueError, match="schema version 99 is not supported"):
        TrajectoryStore(tmp_path / "a.sqlite", readonly=True)


def test_run_config_and_state(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        store.set_run_config({"env": {"name": "calc", "n": 1}})
        store.set_state("rollout", [1, 2, {"a": None}])
    with TrajectoryStore(tmp_path, readonly=True) as store:
        assert store.run_config() == {"env": {"name": "calc", "n": 1}}
        assert store.get_state("rollout") == [1, 2, {"a": None}]
        assert store.get_state("missing") is None


# ----------------------------------------------------------------------------- crash safety

WRITER = textwrap.dedent(
    """
    import sys
    from agentrl.store import TrajectoryStore
    from agentrl.types import Message, Trajectory

    store = TrajectoryStore(sys.argv[1], commit_every=5, commit_interval_s=3600)
    i = 0
    while True:
        t = Trajectory(task_id=f"t{i}", env="e", messages=[Message("user", "x" * (i % 300))],
                       token_ids=list(range(i % 500)), loss_mask=[1] * (i % 500),
                       logprobs=[-0.25] * (i % 500), versions=[i] * (i % 500), id=f"traj-{i}")
        store.set_state("cursor", i + 1)  # same transaction as the trajectory it counts
        store.add_trajectory(t, step=i // 10, status="trained")
        i += 1
        if store.committed_trajectories and i % 5 == 0:
            print(store.committed_trajectories, flush=True)
    """
)


def test_kill_9_mid_stream_keeps_every_committed_row(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    db = tmp_path / "run" / STORE_FILENAME
    proc = subprocess.Popen([sys.executable, str(script), str(db)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    reported = 0
    try:
        deadline = time.monotonic() + 120
        while reported < 300 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            reported = int(line)
            if reported >= 150:  # read live while the writer writes
                with TrajectoryStore(db, readonly=True) as reader:
                    assert reader.count() >= reported
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert reported >= 300, "the writer did not get far enough"

    with TrajectoryStore(db) as store:  # reopening as a writer recovers the WAL
        assert store.integrity_check() == "ok"
        n = store.count()
        assert n >= reported and n % 5 == 0  # whole batches only
        assert store.get_state("cursor") == n  # the cursor committed with exactly its batch
        ids = [r["id"] for r in store.query(order="oldest", limit=1000)]
        ids += [r["id"] for r in store.query(order="oldest", limit=1000, offset=1000)]
        assert ids[:n] == [f"traj-{i}" for i in range(n)][: len(ids)]
        for i in range(0, n, 37):
            t = store.get_trajectory(f"traj-{i}")
            assert t.token_ids == list(range(i % 500)) and t.versions == [i] * (i % 500)
            assert t.messages[0].content == "x" * (i % 300)
        # the store keeps working after the crash
        store.add_trajectory(_traj(10**6), step=0, status="trained")
    with TrajectoryStore(db, readonly=True) as store:
        assert store.count() == n + 1
        assert store.integrity_check() == "ok"


# ----------------------------------------------------------------------------- export


def test_export_jsonl_and_parquet_load_in_datasets(
    synthetic: tuple[Path, list[Trajectory]], tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    from agentrl.export import row_to_trajectory

    path, trajs = synthetic
    with TrajectoryStore(path, readonly=True) as store:
        n_json = store.export_jsonl(tmp_path / "t.jsonl")
        n_parquet = store.export_parquet(tmp_path / "t.parquet")
    assert n_json == n_parquet == len(trajs)
    original = {t.id: t for t in trajs}
    cache = str(tmp_path / "hf-cache")
    for kind, file in (("json", "t.jsonl"), ("parquet", "t.parquet")):
        ds = datasets.load_dataset(kind, data_files=str(tmp_path / file), split="train", cache_dir=cache)
        assert ds.num_rows == len(trajs)
        assert {"id", "messages", "token_ids", "loss_mask", "logprobs", "reward", "step"} <= set(
            ds.column_names
        )
        for row in ds:
            back = row_to_trajectory(row)
            want = original[back.id]
            if back.id == "nan-reward":
                assert math.isnan(back.reward)
                back.reward = want.reward
            assert canon(back) == canon(want)


def test_moving_a_group_to_another_step_keeps_step_stats_exact(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        groups = fill_store(store, steps=3, groups_per_step=2, group_size=3, seed=11)
        moved = groups[0]  # stored at step 1
        store.set_group_step(moved.id, step=3)
        store.commit()
        assert {r["step"] for r in store.group_members(moved.id)} == {3}
        group = store.group(moved.id)
        assert group is not None and group["step"] == 3
        by_step: dict[int, list[Trajectory]] = {}
        for g, step in zip(groups, [1, 1, 2, 2, 3, 3], strict=True):
            by_step.setdefault(3 if g is moved else step, []).extend(g.trajectories)
        rows = store.step_rewards()
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            rewards = [t.reward for t in by_step[row["step"]]]
            assert row["count"] == len(rewards)
            assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
            assert (row["reward_min"], row["reward_max"]) == (min(rewards), max(rewards))
        assert store.count(TrajectoryFilter(step_min=3, step_max=3)) == 9
