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

from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.synthetic import fill_store
from agentrl.store.schema import decode_array, encode_array
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
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
        row = TrajectoryQueries(store).query(TrajectoryFilter(group_id=t.group_id), order="oldest")[2]
        assert row["id"] == t.id
        assert row["num_tokens"] == len(t.token_ids)
        assert row["num_sampled"] == sum(t.loss_mask)
        assert row["error_class"] == (t.error.kind.value if t.error else None)
        # list rows count the episode (after the recorded prompt), never the demonstrations
        everything = [u for g in groups for u in g.trajectories]
        assert any(u.env == "calculator" for u in everything)  # whose prompts carry a demonstration
        rows = {r["id"]: r for r in TrajectoryQueries(store).query(limit=1000)}
        for u in everything:
            row = rows[u.id]
            assert u.prompt_messages is not None
            episode = u.messages[u.prompt_messages :]
            assert row["tools"] == sorted({c.name for m in episode for c in m.tool_calls})
            assert row["num_turns"] == len(u.turns) == sum(m.role == "assistant" for m in episode)
            assert row["num_tool_calls"] == sum(len(turn.tool_calls) for turn in u.turns)
            asked = " ".join(u.messages[u.prompt_messages - 1].content.split())
            assert str(row["preview"]).startswith(asked[:100])
        assert row["error_class"] == (t.error.kind.value if t.error else None)
        with pytest.raises(KeyError, match="nope"):
            store.get_trajectory("nope")


def test_metrics_keep_last_value_and_nan(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path) as store:
        store.add_metrics(3, {"a": 1.0, "b": math.nan})
        store.add_metrics(3, {"a": 2.0})
        store.add_metrics(1, {"a": -math.inf})
        got = store.metrics()
    assert got[0] == (1, {"a": -math.inf})
    assert got[1][0] == 3 and got[1][1]["a"] == 2.0 and math.isnan(got[1][1]["b"])


def test_duplicate_id_is_refused(tmp_path: Path) -> None:
    t = Trajectory(task_id="t", env="e", messages=[], token_ids=[], loss_mask=[], logprobs=[], versions=[])
    with TrajectoryStore(tmp_path) as store:
        store.add_trajectory(t, step=0, status="trained")
        with pytest.raises(ValueError, match="already in"):
            store.add_trajectory(t, step=0, status="trained")


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
    from agentrl.store.trajectory_store import TrajectoryStore
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
        q = TrajectoryQueries(store)
        ids = [r["id"] for r in q.query(order="oldest", limit=1000)]
        ids += [r["id"] for r in q.query(order="oldest", limit=1000, offset=1000)]
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


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Trajectory]]:
    """A synthetic run's store (with demonstrations in some prompts) plus a NaN-reward trajectory."""
    path = tmp_path_factory.mktemp("synthetic") / STORE_FILENAME
    with TrajectoryStore(path) as store:
        groups = fill_store(store, steps=3, groups_per_step=4, group_size=4, seed=7)
        odd = groups[0].trajectories[0]
        nan_traj = Trajectory.from_dict({**odd.to_dict(), "id": "nan-reward", "reward": "nan"})
        store.add_trajectory(nan_traj, step=None, status="eval")
    return path, [*(t for g in groups for t in g.trajectories), nan_traj]


def test_export_jsonl_and_parquet_load_in_datasets(
    synthetic: tuple[Path, list[Trajectory]], tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    from agentrl.store.export import row_to_trajectory

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


# ----------------------------------------------------------------------------- schema 1 stores

STORE_V1 = Path(__file__).parents[1] / "data" / "store_v1.sqlite"
"""A store written by agentrl's store as of commit c8a993c (schema 1): real SmolLM2-135M calculator
episodes (two eval, one training group of 8) whose prompts carry two few-shot demonstrations, stored
without `Trajectory.prompt_messages`. Schema 1 counted 6 turns and 3 tool calls for each (the
demonstrations included), previewed the first demonstration and indexed it for search."""


def _raw(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    db = sqlite3.connect(path)
    try:
        return {
            table: db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
            for table in ("trajectory_data", "groups", "metrics", "state")
        }
    finally:
        db.close()


def test_a_schema_1_store_reads_as_is_and_upgrades_without_loss(tmp_path: Path) -> None:
    from agentrl.store.trajectory_store import upgrade_store

    path = tmp_path / STORE_FILENAME
    path.write_bytes(STORE_V1.read_bytes())
    with TrajectoryStore(path, readonly=True) as old:
        assert old.schema_version == 1
        before = [canon(r.trajectory) for r in old.iter_records()]  # training-side reads need no upgrade
        trajs = [r.trajectory for r in old.iter_records()]
        with pytest.raises(ValueError, match=r"older agentrl.*upgrade"):
            TrajectoryQueries(old)
        stale = old.read("SELECT num_turns, num_tool_calls, preview FROM trajectories")
        demo = trajs[0].messages[1].content  # the first demonstration's question
        assert {(n, c) for n, c, _ in stale} == {(6, 3)} and len({p.split(" ⟶ ")[0] for *_, p in stale}) == 1
        assert all(p.startswith(" ".join(demo.split())[:60]) for *_, p in stale)
    raw = _raw(path)
    assert all(t.prompt_messages is None and len(t.turns) == 2 for t in trajs)

    assert upgrade_store(path) == 1
    assert upgrade_store(path) is None
    assert _raw(path) == raw  # documents, token arrays, groups, metrics and state untouched
    with TrajectoryQueries.open(path) as q:
        assert q.store.schema_version == 2 and q.store.integrity_check() == "ok"
        assert [canon(r.trajectory) for r in q.store.iter_records()] == before
        rows = {r["id"]: r for r in q.query(limit=100)}
        for t in trajs:
            row = rows[t.id]
            assert row["num_turns"] == len(t.turns) == 2
            assert row["num_tool_calls"] == sum(len(u.tool_calls) for u in t.turns) == 1
            asked = t.messages[9].content  # the task: the user message after the two demonstrations
            assert str(row["preview"]).startswith(" ".join(asked.split())[:100]), row["preview"]
            assert t.messages[-1].content.strip()[:20] in str(row["preview"])
        assert len({str(r["preview"]).split(" ⟶ ")[0] for r in rows.values()}) == 3  # 3 distinct tasks
        assert q.count(TrajectoryFilter(search=demo)) == 0
        assert q.count(TrajectoryFilter(search=trajs[0].messages[9].content)) >= 1
        assert q.distinct("tool") == ["calculator"]
        # eval episodes (step 0) no longer enter the per-step training stats
        assert [r["step"] for r in q.step_rewards()] == [1]
        assert q.step_rewards()[0]["count"] == 8


def test_opening_a_schema_1_store_for_writing_upgrades_it(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILENAME
    path.write_bytes(STORE_V1.read_bytes())
    with TrajectoryStore(path) as store:  # what a resumed run does
        assert store.schema_version == 2
        assert {r[0] for r in store.read("SELECT num_turns FROM trajectories")} == {2}
        store.add_trajectory(_traj(0), step=2, status="trained")
    with TrajectoryQueries.open(path) as q:
        assert q.count() == 11 and [r["step"] for r in q.step_rewards()] == [1, 2]


def test_upgrading_adds_the_eval_metrics_the_run_logged_beside_its_store(tmp_path: Path) -> None:
    """Runs of schema-1 days stored eval metrics in metrics.jsonl only; the upgrade adds what is missing."""
    from agentrl.store.trajectory_store import upgrade_store

    (tmp_path / STORE_FILENAME).write_bytes(STORE_V1.read_bytes())
    with TrajectoryStore(tmp_path, readonly=True) as old:
        stored = dict(old.metrics())
    assert stored[1]["reward/mean"] == pytest.approx(0.3125) and 0 not in stored
    rows = [
        {"step": -1, "sft/loss": 2.0},
        {"step": 0, "time": 1.0, "eval/reward_mean": 0.375, "eval/pass@1": 0.375, "note": "text"},
        {"step": 1, "reward/mean": 99.0, "time/wall_s": 118.7},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert upgrade_store(tmp_path) == 1
    with TrajectoryStore(tmp_path, readonly=True) as new:
        got = dict(new.metrics())
    assert got[0] == {"eval/reward_mean": 0.375, "eval/pass@1": 0.375}
    assert got[1] == {**stored[1], "time/wall_s": 118.7}  # the stored reward/mean is kept
    assert -1 not in got
