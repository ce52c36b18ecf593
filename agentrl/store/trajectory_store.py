"""The trajectory store: one SQLite file per run (RUN_DIR/trajectories.sqlite), the run's write log.

Why SQLite in WAL mode: appends are cheap, a crash of the writer leaves a valid
file that holds every committed transaction, and readers (the replay UI, a
notebook) read a consistent snapshot while training keeps writing.

This module is what training needs: writing trajectories, groups, metrics and
run state, and reading back what a run resumes or warm-starts from (records,
the groups' task-stream cursors, solved counts, groups after a step). The
replay UI's queries (filters, full-text search, pages, distinct values) live
in `agentrl.replay.queries`; the tables in `agentrl.store.schema`.

Writes go into one open transaction that is committed every `commit_every`
trajectories or `commit_interval_s` seconds (checked on each write), on
`commit()` and on `close()`. The resume cursors are the task-stream positions
stored with each group (`groups.cursor`, read by `cursors()`), so they commit
with the groups themselves; `set_state` (other run state, e.g. eval summaries)
writes into that same transaction, so nothing it says runs ahead of the data.

With `synchronous=NORMAL` a process crash (even `kill -9`) loses only the open
transaction; an OS crash or power loss may also lose the last few commits but
still leaves a valid database.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from agentrl.rollout.task_stream import CURSOR_KEY, solved_key
from agentrl.store import schema as store_schema
from agentrl.store.schema import (
    READABLE_VERSIONS,
    STEP_STATS_RECOUNT,
    STEP_STATS_UPSERT,
    STORE_SCHEMA_VERSION,
    SUCCESS_REWARD,
    SUMMARY_COLUMNS,
    decode_array,
    encode_array,
    trajectory_policies,
)
from agentrl.store.summary import summarize
from agentrl.types import JSON, Group, Trajectory

STORE_FILENAME = "trajectories.sqlite"

_RECORD_SQL = (
    "SELECT t.seq, t.step, t.status, t.created_at, d.token_ids, d.loss_mask, d.logprobs, d.versions, d.doc "
    "FROM trajectories t JOIN trajectory_data d ON d.seq = t.seq "
)


@dataclass(frozen=True, slots=True)
class StoredTrajectory:
    """A trajectory with where it sits in the run."""

    trajectory: Trajectory
    seq: int
    step: int | None
    status: str
    created_at: float


class TrajectoryStore:
    """Append-only trajectory store of one run. Usable as a context manager.

    `path` is the SQLite file or a run directory (then RUN_DIR/trajectories.sqlite).
    `readonly=True` opens the file with SQLite's `mode=ro` (the file must exist);
    every write method then raises. Opening an older store for writing upgrades
    it in place (`store_schema.migrate`); read-only, an older store's records
    read as they are (`schema_version` says which layout its summaries follow).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        readonly: bool = False,
        commit_every: int = 64,
        commit_interval_s: float = 1.0,
    ) -> None:
        self.path = resolve_store_path(path)
        self.readonly = readonly
        self.commit_every = commit_every
        self.commit_interval_s = commit_interval_s
        self.committed_trajectories = 0
        """Trajectories this object has committed so far (not counting older ones)."""
        self._lock = threading.RLock()
        self._pending = 0
        self._pending_trajectories = 0
        self._in_txn = False
        self._last_commit = time.monotonic()
        if commit_every < 1:
            raise ValueError(f"commit_every={commit_every} must be >= 1")
        if readonly:
            if not self.path.is_file():
                raise FileNotFoundError(f"no trajectory store at {self.path}")
            uri = self.path.resolve().as_uri() + "?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.execute("PRAGMA query_only=1")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=5000")
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._create_schema()
        self.schema_version = self._check_schema()

    # -- lifecycle ---------------------------------------------------------

    def _create_schema(self) -> None:
        # executescript would commit implicitly; run statements in one explicit txn
        self._db.execute("BEGIN IMMEDIATE")
        try:
            store_schema.create(self._db, time.time())
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _check_schema(self) -> int:
        try:
            found = store_schema.version(self._db)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise ValueError(f"{self.path} is not an agentrl trajectory store ({e})") from None
        allowed = READABLE_VERSIONS if self.readonly else (STORE_SCHEMA_VERSION,)
        if found is None or found not in allowed:
            self._db.close()
            raise ValueError(
                f"{self.path}: store schema version {found} is not supported "
                f"(this agentrl reads versions {', '.join(map(str, READABLE_VERSIONS))})"
            )
        return found

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Commit what is pending and close the file. Safe to call twice."""
        with self._lock:
            if self._db is None:
                return
            if not self.readonly:
                self.commit()
            self._db.close()
            self._db = None  # type: ignore[assignment]

    def commit(self) -> None:
        """Commit the open batch (trajectories, groups, metrics and state together)."""
        with self._lock:
            if self._in_txn:
                self._db.execute("COMMIT")
                self._in_txn = False
                self.committed_trajectories += self._pending_trajectories
            self._pending = 0
            self._pending_trajectories = 0
            self._last_commit = time.monotonic()

    # -- writing -----------------------------------------------------------

    def _begin(self) -> None:
        if self.readonly:
            raise PermissionError(f"{self.path} is opened read-only")
        if not self._in_txn:
            self._db.execute("BEGIN IMMEDIATE")
            self._in_txn = True

    def _maybe_commit(self) -> None:
        due = time.monotonic() - self._last_commit >= self.commit_interval_s
        if self._pending_trajectories >= self.commit_every or due:
            self.commit()

    def set_run_config(self, config: Mapping[str, JSON]) -> None:
        """Store the run's resolved config (replaces an earlier one); committed at once."""
        with self._lock:
            self._begin()
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('run_config', ?)", (json.dumps(dict(config)),)
            )
            self.commit()

    def add_group(self, group: Group, *, step: int | None, status: str = "trained") -> None:
        """Store a group and all its trajectories (with the group's step and status)."""
        rewards = [r for r in group.rewards if math.isfinite(r)]
        mean = sum(rewards) / len(rewards) if rewards else None
        std = (
            math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
            if rewards and mean is not None
            else None
        )
        with self._lock:
            self._begin()
            self._db.execute(
                "INSERT OR REPLACE INTO groups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (group.id, group.task_id, step, status, len(group.trajectories), mean, std,
                 json.dumps(group.task), time.time(), _cursor(group)),
            )  # fmt: skip
            self._pending += 1
            for traj in group.trajectories:
                if not traj.group_id:
                    raise ValueError(f"trajectory {traj.id} of group {group.id} has no group_id")
                self._insert_trajectory(traj, step=step, status=status)
            self._maybe_commit()

    def set_group_step(self, group_id: str, *, step: int, status: str = "trained") -> None:
        """Re-assign a stored group (and its trajectories) to a step, e.g. when a resumed
        run trains again the groups whose weights were lost with the crash."""
        with self._lock:
            self._begin()
            old = [r[0] for r in self._db.execute("SELECT DISTINCT step FROM trajectories WHERE group_id = ?",
                                                  (group_id,))]  # fmt: skip
            self._db.execute("UPDATE groups SET step = ?, status = ? WHERE id = ?", (step, status, group_id))
            self._db.execute(
                "UPDATE trajectories SET step = ?, status = ? WHERE group_id = ?", (step, status, group_id)
            )
            for s in {s for s in (*old, step) if s is not None}:  # recount the steps it left and joined
                self._db.execute("DELETE FROM step_stats WHERE step = ?", (s,))
                self._db.execute(STEP_STATS_RECOUNT.format(where="AND step = ?"), (s,))
            self._maybe_commit()

    def add_trajectory(self, traj: Trajectory, *, step: int | None, status: str) -> None:
        """Append one trajectory (status: trained, dropped, eval, ...)."""
        with self._lock:
            self._begin()
            self._insert_trajectory(traj, step=step, status=status)
            self._maybe_commit()

    def _insert_trajectory(self, traj: Trajectory, *, step: int | None, status: str) -> None:
        doc = traj.to_dict()
        for key in ("token_ids", "loss_mask", "logprobs", "versions"):
            del doc[key]
        summary = summarize(traj)
        versions = traj.policy_versions
        reward = traj.reward if math.isfinite(traj.reward) else None
        try:
            cur = self._db.execute(
                f"INSERT INTO trajectories ({', '.join(SUMMARY_COLUMNS[1:])}) "
                f"VALUES ({', '.join('?' * (len(SUMMARY_COLUMNS) - 1))})",
                (
                    traj.id, traj.group_id, traj.sample_index, traj.task_id, traj.env, step, status,
                    reward, int(traj.terminated), int(traj.truncated),
                    traj.error.kind.value if traj.error else None,
                    len(traj.token_ids), traj.num_sampled_tokens, summary.num_turns, summary.num_tool_calls,
                    json.dumps(summary.tools), versions[0] if versions else None,
                    versions[1] if versions else None, summary.preview, time.time(),
                ),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise ValueError(f"trajectory {traj.id} is already in {self.path}") from None
        seq = cur.lastrowid
        self._db.execute(
            "INSERT INTO trajectory_data VALUES (?, ?, ?, ?, ?, ?)",
            (
                seq,
                encode_array(traj.token_ids, "int"),
                encode_array(traj.loss_mask, "int"),
                encode_array(traj.logprobs, "float"),
                encode_array(traj.versions, "int"),
                json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
            ),
        )
        self._db.executemany("INSERT INTO traj_tools VALUES (?, ?)", [(t, seq) for t in summary.tools])
        self._db.executemany(
            "INSERT INTO traj_policies VALUES (?, ?)", [(p, seq) for p in trajectory_policies(traj)]
        )
        if step is not None and status != "eval":
            success = int(reward is not None and reward >= SUCCESS_REWARD)
            self._db.execute(
                STEP_STATS_UPSERT,
                (step, 0 if reward is None else 1, reward or 0.0, reward, reward, len(traj.token_ids),
                 int(traj.error is not None), int(traj.truncated), success),
            )  # fmt: skip
        self._db.execute("INSERT INTO traj_fts (rowid, text) VALUES (?, ?)", (seq, summary.search_text))
        self._pending += 1
        self._pending_trajectories += 1

    def add_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record per-step metrics (a key written twice for a step keeps the last value)."""
        with self._lock:
            self._begin()
            self._db.executemany(
                "INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)",
                [(step, k, float(v) if not math.isnan(float(v)) else None) for k, v in metrics.items()],
            )
            self._pending += 1
            self._maybe_commit()

    def set_state(self, key: str, value: JSON) -> None:
        """Write run state into the open batch: it commits with the data written before it."""
        with self._lock:
            self._begin()
            self._db.execute(
                "INSERT OR REPLACE INTO state VALUES (?, ?, ?)", (key, json.dumps(value), time.time())
            )
            self._pending += 1

    # -- reading back ------------------------------------------------------

    def read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one SQL query under the store's lock and return its rows.

        For read layers over this store's tables (`agentrl.replay.queries`).
        """
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def get_state(self, key: str) -> JSON | None:
        rows = self.read("SELECT value FROM state WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def run_config(self) -> dict[str, JSON] | None:
        rows = self.read("SELECT value FROM meta WHERE key='run_config'")
        return dict(json.loads(rows[0][0])) if rows else None

    def count(self) -> int:
        """How many trajectories are stored (committed, or written by this object)."""
        return int(self.read("SELECT count(*) FROM trajectories")[0][0])

    def get_trajectory(self, id: str) -> Trajectory:
        """The stored trajectory, exactly as it was added. KeyError if unknown."""
        return self.get_record(id).trajectory

    def get_record(self, id: str) -> StoredTrajectory:
        rows = self.read(_RECORD_SQL + "WHERE t.id = ?", (id,))
        if not rows:
            raise KeyError(f"no trajectory with id {id!r} in {self.path}")
        return _record(rows[0])

    def iter_records(self, *, batch_size: int = 256) -> Iterator[StoredTrajectory]:
        """Every stored trajectory in insertion order, read in batches."""
        last = 0
        while True:
            rows = self.read(_RECORD_SQL + "WHERE t.seq > ? ORDER BY t.seq LIMIT ?", (last, batch_size))
            if not rows:
                return
            for row in rows:
                yield _record(row)
            last = rows[-1][0]

    def cursors(self) -> list[int]:
        """Task-stream positions (`task["_cursor"]`) of every stored non-eval group.

        What `TaskStream.iterate(done=...)` needs to resume: committed with the
        groups themselves, so it never runs ahead of the stored data.
        """
        rows = self.read(
            "SELECT cursor FROM groups WHERE cursor IS NOT NULL AND status != 'eval' ORDER BY cursor"
        )
        return [int(r[0]) for r in rows]

    def solved_counts(self, threshold: float) -> dict[str, int]:
        """Per task key (`solved_key`): stored training groups whose every sample reached `threshold`.

        Trained groups and groups dropped by dynamic sampling count (both were
        sampled from the policy in training); eval groups do not.
        """
        rows = self.read(
            "SELECT g.task FROM groups g JOIN trajectories t ON t.group_id = g.id "
            "WHERE g.status IN ('trained', 'dropped:dynamic_sampling') "
            "GROUP BY g.id HAVING MIN(t.reward) >= ? AND COUNT(t.reward) = COUNT(*)",
            (threshold,),
        )
        counts: dict[str, int] = {}
        for (task,) in rows:
            key = solved_key(json.loads(task))
            counts[key] = counts.get(key, 0) + 1
        return counts

    def groups_after(self, step: int, *, status: str | None = "trained") -> list[Group]:
        """Stored groups with a step > `step` (and that status), in the order they were stored."""
        sql = "SELECT id, task_id, task FROM groups WHERE step > ?"
        args: list[Any] = [step]
        if status is not None:
            sql += " AND status = ?"
            args.append(status)
        out = []
        for group_id, task_id, task in self.read(sql + " ORDER BY step, rowid", args):
            rows = self.read(_RECORD_SQL + "WHERE t.group_id = ? ORDER BY t.sample_index, t.seq", (group_id,))
            out.append(
                Group(task_id=task_id, id=group_id, task=json.loads(task),
                      trajectories=[_record(r).trajectory for r in rows])
            )  # fmt: skip
        return out

    def metrics(self) -> list[tuple[int, dict[str, float]]]:
        """Per-step metrics, ordered by step (a NULL value reads as NaN)."""
        out: list[tuple[int, dict[str, float]]] = []
        for step, key, value in self.read("SELECT step, key, value FROM metrics ORDER BY step, key"):
            if not out or out[-1][0] != step:
                out.append((step, {}))
            out[-1][1][key] = math.nan if value is None else value
        return out

    def integrity_check(self) -> str:
        """SQLite's PRAGMA integrity_check ("ok" for a sound file)."""
        return "\n".join(r[0] for r in self.read("PRAGMA integrity_check"))

    # -- export ------------------------------------------------------------

    def export_jsonl(self, path: str | Path) -> int:
        """One JSON object per trajectory (see agentrl.store.export); returns the row count."""
        from agentrl.store.export import export_jsonl

        return export_jsonl(self, path)

    def export_parquet(self, path: str | Path) -> int:
        """One Parquet row per trajectory (needs pyarrow); returns the row count."""
        from agentrl.store.export import export_parquet

        return export_parquet(self, path)


def resolve_store_path(path: str | Path) -> Path:
    """A run directory -> its store file; a file path is used as is."""
    p = Path(path)
    if p.is_dir() or (not p.suffix and not p.exists()):
        return p / STORE_FILENAME
    return p


def upgrade_store(path: str | Path) -> int | None:
    """Upgrade an older store file in place (opened for writing once); returns the version it had.

    None when it already had this version. For tools that then open it
    read-only (`agentrl replay`, `agentrl show`). Runs of that time stored no
    eval metrics in the store (only in their metrics.jsonl): those beside the
    store are added (`add_logged_metrics`).
    """
    target = resolve_store_path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no trajectory store at {target}")
    with TrajectoryStore(target, readonly=True) as store:
        found = store.schema_version
    if found == STORE_SCHEMA_VERSION:
        return None
    with TrajectoryStore(target) as store:
        log = target.parent / "metrics.jsonl"
        if log.is_file():
            add_logged_metrics(store, log)
    return found


def add_logged_metrics(store: TrajectoryStore, metrics_jsonl: Path) -> int:
    """Add the per-step values of a run's metrics.jsonl that the store lacks; returns how many.

    Values the store holds are kept; warm-start rows (negative steps) and
    non-numeric fields are skipped. Committed at once.
    """
    have = {(step, key) for step, key in store.read("SELECT step, key FROM metrics")}
    added = 0
    for line in metrics_jsonl.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        step = row.get("step")
        if not isinstance(step, int) or step < 0:
            continue
        new = {k: float(v) for k, v in row.items() if k not in ("step", "time") and (step, k) not in have
               and isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        if new:
            store.add_metrics(step, new)
            added += len(new)
    store.commit()
    return added


def _record(row: Sequence[Any]) -> StoredTrajectory:
    seq, step, status, created_at, token_ids, loss_mask, logprobs, versions, doc_text = row
    doc = json.loads(doc_text)
    doc["token_ids"] = decode_array(token_ids)
    doc["loss_mask"] = decode_array(loss_mask)
    doc["logprobs"] = decode_array(logprobs)
    doc["versions"] = decode_array(versions)
    return StoredTrajectory(
        Trajectory.from_dict(doc), seq=seq, step=step, status=status, created_at=created_at
    )


def _cursor(group: Group) -> int | None:
    """The task-stream position a group answered, if its task carries one."""
    for task in (group.task, *(t.task for t in group.trajectories[:1])):
        position = task.get(CURSOR_KEY)
        if isinstance(position, int) and not isinstance(position, bool):
            return position
    return None
