"""The trajectory store: one SQLite file per run (RUN_DIR/trajectories.sqlite).

Why SQLite in WAL mode: appends are cheap, a crash of the writer leaves a valid
file that holds every committed transaction, and readers (the replay UI, a
notebook) read a consistent snapshot while training keeps writing.

Layout (see `_SCHEMA`):
- `trajectories`: one narrow row per trajectory with the columns the replay UI
  filters and sorts on, each indexed together with `seq` (insertion order), so
  a filtered page is an index range scan even with 100k rows;
- `trajectory_data`: the payload, kept apart so list queries never read it:
  the four per-token arrays as compact typed blobs (see `encode_array`) and
  everything else of the trajectory as JSON;
- `traj_tools` (which tools a trajectory called), `traj_fts` (FTS5 full-text
  index over message text), `groups`, `metrics` (per step), `meta` (run config,
  schema version) and `state` (resume cursors).

Writes go into one open transaction that is committed every `commit_every`
trajectories or `commit_interval_s` seconds (checked on each write), on
`commit()` and on `close()`. `set_state` writes into that same transaction, so
a resume cursor is never committed ahead of the trajectories it accounts for.

With `synchronous=NORMAL` a process crash (even `kill -9`) loses only the open
transaction; an OS crash or power loss may also lose the last few commits but
still leaves a valid database.
"""

from __future__ import annotations

import base64
import json
import math
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from agentrl.task_stream import CURSOR_KEY, solved_key
from agentrl.types import JSON, Group, Trajectory

STORE_FILENAME = "trajectories.sqlite"
STORE_SCHEMA_VERSION = 1

Order = Literal["newest", "oldest", "reward_desc", "reward_asc", "length_desc", "length_asc"]
ORDERS: dict[str, tuple[str | None, bool]] = {
    # order name -> (sort column or None for seq only, descending?)
    "newest": (None, True),
    "oldest": (None, False),
    "reward_desc": ("reward", True),
    "reward_asc": ("reward", False),
    "length_desc": ("num_tokens", True),
    "length_asc": ("num_tokens", False),
}

_SUMMARY_COLUMNS = (
    "seq", "id", "group_id", "sample_index", "task_id", "env", "step", "status", "reward",
    "terminated", "truncated", "error_class", "num_tokens", "num_sampled", "num_turns",
    "num_tool_calls", "tools", "version_min", "version_max", "preview", "created_at",
)  # fmt: skip

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY, task_id TEXT NOT NULL, step INTEGER, status TEXT NOT NULL,
    size INTEGER NOT NULL, reward_mean REAL, reward_std REAL, task TEXT NOT NULL, created_at REAL NOT NULL,
    cursor INTEGER
);
CREATE INDEX IF NOT EXISTS groups_step ON groups(step);
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    task_id TEXT NOT NULL,
    env TEXT NOT NULL,
    step INTEGER,
    status TEXT NOT NULL,
    reward REAL,
    terminated INTEGER NOT NULL,
    truncated INTEGER NOT NULL,
    error_class TEXT,
    num_tokens INTEGER NOT NULL,
    num_sampled INTEGER NOT NULL,
    num_turns INTEGER NOT NULL,
    num_tool_calls INTEGER NOT NULL,
    tools TEXT NOT NULL,
    version_min INTEGER,
    version_max INTEGER,
    preview TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS traj_step ON trajectories(step, seq);
CREATE INDEX IF NOT EXISTS traj_env ON trajectories(env, seq);
CREATE INDEX IF NOT EXISTS traj_status ON trajectories(status, seq);
CREATE INDEX IF NOT EXISTS traj_reward ON trajectories(reward, seq);
CREATE INDEX IF NOT EXISTS traj_error ON trajectories(error_class, seq);
CREATE INDEX IF NOT EXISTS traj_truncated ON trajectories(truncated, seq);
CREATE INDEX IF NOT EXISTS traj_length ON trajectories(num_tokens, seq);
CREATE INDEX IF NOT EXISTS traj_task ON trajectories(task_id, seq);
CREATE INDEX IF NOT EXISTS traj_group ON trajectories(group_id, sample_index);
CREATE TABLE IF NOT EXISTS trajectory_data (
    seq INTEGER PRIMARY KEY,
    token_ids BLOB NOT NULL,
    loss_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    versions BLOB NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS traj_tools (
    tool TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (tool, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS step_stats (
    step INTEGER PRIMARY KEY, count INTEGER NOT NULL, rewards INTEGER NOT NULL, reward_sum REAL NOT NULL,
    reward_min REAL, reward_max REAL, tokens_sum INTEGER NOT NULL, errors INTEGER NOT NULL,
    truncated INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    step INTEGER NOT NULL, key TEXT NOT NULL, value REAL, PRIMARY KEY (step, key)
) WITHOUT ROWID;
CREATE VIRTUAL TABLE IF NOT EXISTS traj_fts USING fts5(
    text, content='', tokenize='unicode61 remove_diacritics 2'
);
"""


# ---------------------------------------------------------------------------
# compact per-token arrays

_INT_CODES = (("B", 0, 2**8 - 1), ("b", -(2**7), 2**7 - 1), ("H", 0, 2**16 - 1), ("h", -(2**15), 2**15 - 1),
              ("I", 0, 2**32 - 1), ("i", -(2**31), 2**31 - 1), ("q", -(2**63), 2**63 - 1))  # fmt: skip


def encode_array(values: Sequence[int] | Sequence[float], kind: Literal["int", "float"]) -> bytes:
    """Pack a list of numbers into one byte typecode + little-endian machine values.

    Ints take the smallest `array` type that holds them all (token ids of a 49k
    vocab: 2 bytes each). Floats are stored as float32 when every value survives
    the round trip bit-exactly (engines produce float32 logprobs), else float64,
    so decoding always gives back exactly the values written.
    """
    arr: array[Any]
    if kind == "int":
        lo, hi = (min(values), max(values)) if values else (0, 0)
        code = next((c for c, cmin, cmax in _INT_CODES if cmin <= lo and hi <= cmax), None)
        if code is None:
            raise ValueError(f"integer array value out of int64 range ({lo}..{hi})")
        arr = array(code, values)  # type: ignore[arg-type]
    else:
        doubles = array("d", values)
        single = array("f", values)
        arr = single if array("d", single).tobytes() == doubles.tobytes() else doubles
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.typecode.encode("ascii") + arr.tobytes()


def decode_array(blob: bytes) -> list[Any]:
    """Inverse of `encode_array`."""
    arr = array(chr(blob[0]))
    arr.frombytes(blob[1:])
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


# ---------------------------------------------------------------------------
# filters


@dataclass(frozen=True, slots=True)
class TrajectoryFilter:
    """What the trajectory list may be filtered on; every field is optional.

    `error` is an ErrorClass value ("env", "tool", ...), "none" (no error) or
    "any" (any error). `tool` matches trajectories that called that tool.
    `search` is full text over messages (words, all must match; `word*` for a
    prefix); quotes and FTS operators in it are taken literally.
    """

    step_min: int | None = None
    step_max: int | None = None
    env: str | None = None
    status: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    error: str | None = None
    truncated: bool | None = None
    terminated: bool | None = None
    tool: str | None = None
    length_min: int | None = None
    length_max: int | None = None
    search: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> TrajectoryFilter:
        """Parse string parameters (an HTTP query); empty values mean "no filter".

        Unknown keys are ignored so callers can pass a whole query string; a bad
        value raises ValueError naming the key, the value and what is allowed.
        """
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            raw = params.get(f.name)
            if raw is None or raw.strip() == "":
                continue
            raw = raw.strip()
            kind = str(f.type)
            try:
                if "bool" in kind:
                    if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                        raise ValueError
                    kwargs[f.name] = raw.lower() in ("true", "1", "yes")
                elif "int" in kind:
                    kwargs[f.name] = int(raw)
                elif "float" in kind:
                    kwargs[f.name] = float(raw)
                else:
                    kwargs[f.name] = raw
            except ValueError:
                allowed = "true/false" if "bool" in kind else kind.split(" |")[0] if "|" in kind else kind
                raise ValueError(f"filter {f.name}={raw!r} is not valid: expected {allowed}") from None
        return cls(**kwargs)

    def where(self) -> tuple[str, list[Any]]:
        """The SQL WHERE clause (over `trajectories t`) and its parameters.

        With a full-text search the FTS match list drives the query: the other
        columns are written `+t.col` so SQLite does not pick their index and
        then sort every candidate (a few ms instead of ~100 ms at 100k rows).
        """
        clauses: list[str] = []
        args: list[Any] = []
        match = fts_query(self.search) if self.search else ""
        t = "+t." if match else "t."

        def add(sql: str, *values: Any) -> None:
            clauses.append(sql.replace("t.", t, 1) if sql.startswith("t.") else sql)
            args.extend(values)

        if self.step_min is not None:
            add("t.step >= ?", self.step_min)
        if self.step_max is not None:
            add("t.step <= ?", self.step_max)
        for column in ("env", "status", "task_id", "group_id"):
            value = getattr(self, column)
            if value is not None:
                add(f"t.{column} = ?", value)
        if self.reward_min is not None:
            add("t.reward >= ?", self.reward_min)
        if self.reward_max is not None:
            add("t.reward <= ?", self.reward_max)
        if self.error == "none":
            add("t.error_class IS NULL")
        elif self.error == "any":
            add("t.error_class IS NOT NULL")
        elif self.error is not None:
            add("t.error_class = ?", self.error)
        if self.truncated is not None:
            add("t.truncated = ?", int(self.truncated))
        if self.terminated is not None:
            add("t.terminated = ?", int(self.terminated))
        if self.length_min is not None:
            add("t.num_tokens >= ?", self.length_min)
        if self.length_max is not None:
            add("t.num_tokens <= ?", self.length_max)
        if self.tool is not None:
            clauses.append("t.seq IN (SELECT seq FROM traj_tools WHERE tool = ?)")
            args.append(self.tool)
        if match:
            clauses.append("t.seq IN (SELECT rowid FROM traj_fts WHERE traj_fts MATCH ?)")
            args.append(match)
        return (" AND ".join(clauses) if clauses else "1"), args


def fts_query(text: str) -> str:
    """User words -> an FTS5 query where every word must occur.

    Each word is quoted (so `"`, `-`, `OR`, `:` ... are literal); a trailing `*`
    on a word asks for a prefix match.
    """
    terms = []
    for word in text.split():
        prefix = word.endswith("*") and len(word) > 1
        word = word.rstrip("*") if prefix else word
        if word:
            terms.append('"' + word.replace('"', '""') + '"' + ("*" if prefix else ""))
    return " AND ".join(terms)


@dataclass(frozen=True, slots=True)
class StoredTrajectory:
    """A trajectory with where it sits in the run."""

    trajectory: Trajectory
    seq: int
    step: int | None
    status: str
    created_at: float


# ---------------------------------------------------------------------------
# the store


class TrajectoryStore:
    """Append-only trajectory store of one run. Usable as a context manager.

    `path` is the SQLite file or a run directory (then RUN_DIR/trajectories.sqlite).
    `readonly=True` opens the file with SQLite's `mode=ro` (the file must exist);
    every write method then raises.
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
            self._check_schema()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=5000")
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._create_schema()

    # -- lifecycle ---------------------------------------------------------

    def _create_schema(self) -> None:
        # executescript would commit implicitly; run statements in one explicit txn
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key='store_schema_version'").fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO meta VALUES ('store_schema_version', ?), ('created_at', ?)",
                    (str(STORE_SCHEMA_VERSION), repr(time.time())),
                )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._check_schema()

    def _check_schema(self) -> None:
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key='store_schema_version'").fetchone()
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{self.path} is not an agentrl trajectory store ({e})") from None
        if row is None or int(row[0]) != STORE_SCHEMA_VERSION:
            found = None if row is None else row[0]
            raise ValueError(
                f"{self.path}: store schema version {found} is not supported "
                f"(this agentrl reads version {STORE_SCHEMA_VERSION})"
            )

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Commit what is pending and close the file. Safe to call twice."""
        with self._lock:
            if self._db is None:  # type: ignore[comparison-overlap]
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
            self._refresh_step_stats([*old, step])
            self._maybe_commit()

    def _refresh_step_stats(self, steps: Sequence[int | None]) -> None:
        """Recount `step_stats` rows of these steps from the trajectories (after a move)."""
        for step in {s for s in steps if s is not None}:
            self._db.execute("DELETE FROM step_stats WHERE step = ?", (step,))
            self._db.execute(
                "INSERT INTO step_stats SELECT step, count(*), count(reward), coalesce(sum(reward), 0.0), "
                "min(reward), max(reward), sum(num_tokens), sum(error_class IS NOT NULL), sum(truncated) "
                "FROM trajectories WHERE step = ? GROUP BY step",
                (step,),
            )

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
        tools = sorted({c.name for m in traj.messages for c in m.tool_calls})
        versions = traj.policy_versions
        reward = traj.reward if math.isfinite(traj.reward) else None
        try:
            cur = self._db.execute(
                f"INSERT INTO trajectories ({', '.join(_SUMMARY_COLUMNS[1:])}) "
                f"VALUES ({', '.join('?' * (len(_SUMMARY_COLUMNS) - 1))})",
                (
                    traj.id, traj.group_id, traj.sample_index, traj.task_id, traj.env, step, status,
                    reward, int(traj.terminated), int(traj.truncated),
                    traj.error.kind.value if traj.error else None,
                    len(traj.token_ids), traj.num_sampled_tokens,
                    sum(1 for m in traj.messages if m.role == "assistant"),
                    sum(len(m.tool_calls) for m in traj.messages),
                    json.dumps(tools), versions[0] if versions else None,
                    versions[1] if versions else None, _preview(traj), time.time(),
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
        self._db.executemany("INSERT INTO traj_tools VALUES (?, ?)", [(t, seq) for t in tools])
        if step is not None:
            self._db.execute(
                _STEP_STATS_UPSERT,
                (step, 0 if reward is None else 1, reward or 0.0, reward, reward, len(traj.token_ids),
                 int(traj.error is not None), int(traj.truncated)),
            )  # fmt: skip
        self._db.execute("INSERT INTO traj_fts (rowid, text) VALUES (?, ?)", (seq, _search_text(traj)))
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
        """Write a resume cursor into the open batch: it commits with the data before it."""
        with self._lock:
            self._begin()
            self._db.execute(
                "INSERT OR REPLACE INTO state VALUES (?, ?, ?)", (key, json.dumps(value), time.time())
            )
            self._pending += 1

    # -- reading -----------------------------------------------------------

    def get_state(self, key: str) -> JSON | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def run_config(self) -> dict[str, JSON] | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='run_config'").fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def get_trajectory(self, id: str) -> Trajectory:
        """The stored trajectory, exactly as it was added. KeyError if unknown."""
        return self.get_record(id).trajectory

    def get_record(self, id: str) -> StoredTrajectory:
        with self._lock:
            row = self._db.execute(
                "SELECT t.seq, t.step, t.status, t.created_at, d.token_ids, d.loss_mask, d.logprobs, "
                "d.versions, d.doc FROM trajectories t JOIN trajectory_data d ON d.seq = t.seq "
                "WHERE t.id = ?",
                (id,),
            ).fetchone()
        if row is None:
            raise KeyError(f"no trajectory with id {id!r} in {self.path}")
        return _record(row)

    def iter_records(self, *, batch_size: int = 256) -> Iterator[StoredTrajectory]:
        """Every stored trajectory in insertion order, read in batches."""
        last = 0
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT t.seq, t.step, t.status, t.created_at, d.token_ids, d.loss_mask, d.logprobs, "
                    "d.versions, d.doc FROM trajectories t JOIN trajectory_data d ON d.seq = t.seq "
                    "WHERE t.seq > ? ORDER BY t.seq LIMIT ?",
                    (last, batch_size),
                ).fetchall()
            if not rows:
                return
            for row in rows:
                yield _record(row)
            last = rows[-1][0]

    def query(
        self,
        filters: TrajectoryFilter | None = None,
        *,
        order: str = "newest",
        offset: int = 0,
        limit: int = 50,
        cursor: str | None = None,
    ) -> list[dict[str, JSON]]:
        """Summaries (no tokens, no messages) of matching trajectories, one page."""
        return self.page(filters, order=order, offset=offset, limit=limit, cursor=cursor)[0]

    def page(
        self,
        filters: TrajectoryFilter | None = None,
        *,
        order: str = "newest",
        offset: int = 0,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[dict[str, JSON]], str | None]:
        """One page of summaries and the cursor of the next page (None at the end).

        Pass the returned cursor back for the next page: keyset pagination, so
        page 1000 costs what page 1 costs (an `offset` has to skip rows).
        """
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not valid: expected one of {', '.join(ORDERS)}")
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit={limit} is not valid: expected 1..1000")
        if offset < 0:
            raise ValueError(f"offset={offset} is not valid: expected >= 0")
        column, desc = ORDERS[order]
        where, args = (filters or TrajectoryFilter()).where()
        if cursor:
            key, seq = _decode_cursor(cursor)
            sql, more = _after(column, desc, key, seq)
            where += " AND " + sql
            args += more
        direction = "DESC" if desc else "ASC"
        order_by = f"t.{column} {direction}, t.seq {direction}" if column else f"t.seq {direction}"
        sql = (
            f"SELECT {', '.join('t.' + c for c in _SUMMARY_COLUMNS)} FROM trajectories t "
            f"WHERE {where} ORDER BY {order_by} LIMIT ? OFFSET ?"
        )
        with self._lock:
            rows = self._db.execute(sql, [*args, limit + 1, offset]).fetchall()
        items = [_summary(r) for r in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            next_cursor = _encode_cursor(last[column] if column else None, int(last["seq"]))
        return items, next_cursor

    def count(self, filters: TrajectoryFilter | None = None) -> int:
        where, args = (filters or TrajectoryFilter()).where()
        with self._lock:
            return int(
                self._db.execute(f"SELECT count(*) FROM trajectories t WHERE {where}", args).fetchone()[0]
            )

    def group(self, group_id: str) -> dict[str, JSON] | None:
        """The group row (task, step, status, reward mean/std) or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, task_id, step, status, size, reward_mean, reward_std, task, created_at "
                "FROM groups WHERE id = ?",
                (group_id,),
            ).fetchone()
        if row is None:
            return None
        keys = ("id", "task_id", "step", "status", "size", "reward_mean", "reward_std", "task", "created_at")
        out = dict(zip(keys, row, strict=True))
        out["task"] = json.loads(out["task"])
        return out

    def group_members(self, group_id: str) -> list[dict[str, JSON]]:
        """Summaries of a group's trajectories, by sample index."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join('t.' + c for c in _SUMMARY_COLUMNS)} FROM trajectories t "
                "WHERE t.group_id = ? ORDER BY t.sample_index, t.seq",
                (group_id,),
            ).fetchall()
        return [_summary(r) for r in rows]

    def cursors(self) -> list[int]:
        """Task-stream positions (`task["_cursor"]`) of every stored non-eval group.

        What `TaskStream.iterate(done=...)` needs to resume: committed with the
        groups themselves, so it never runs ahead of the stored data.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT cursor FROM groups WHERE cursor IS NOT NULL AND status != 'eval' ORDER BY cursor"
            ).fetchall()
        return [int(r[0]) for r in rows]

    def solved_counts(self, threshold: float) -> dict[str, int]:
        """Per task key (`solved_key`): stored training groups whose every sample reached `threshold`.

        Trained groups and groups dropped by dynamic sampling count (both were
        sampled from the policy in training); eval groups do not.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT g.task FROM groups g JOIN trajectories t ON t.group_id = g.id "
                "WHERE g.status IN ('trained', 'dropped:dynamic_sampling') "
                "GROUP BY g.id HAVING MIN(t.reward) >= ? AND COUNT(t.reward) = COUNT(*)",
                (threshold,),
            ).fetchall()
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
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY step, rowid", args).fetchall()
        out = []
        for group_id, task_id, task in rows:
            ids = [str(m["id"]) for m in self.group_members(group_id)]
            out.append(
                Group(task_id=task_id, id=group_id, task=json.loads(task),
                      trajectories=[self.get_trajectory(i) for i in ids])
            )  # fmt: skip
        return out

    def metrics(self) -> list[tuple[int, dict[str, float]]]:
        """Per-step metrics, ordered by step."""
        with self._lock:
            rows = self._db.execute("SELECT step, key, value FROM metrics ORDER BY step, key").fetchall()
        out: list[tuple[int, dict[str, float]]] = []
        for step, key, value in rows:
            if not out or out[-1][0] != step:
                out.append((step, {}))
            out[-1][1][key] = math.nan if value is None else value
        return out

    def step_rewards(self) -> list[dict[str, JSON]]:
        """Per step: number of trajectories, their mean/min/max reward, mean length, errors, truncations.

        Kept up to date on every insert (table `step_stats`), so the overview
        costs one row per step, not a scan of every trajectory.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT step, count, CASE WHEN rewards > 0 THEN reward_sum / rewards END, reward_min, reward_max, "
                "CAST(tokens_sum AS REAL) / count, errors, truncated FROM step_stats ORDER BY step"
            ).fetchall()
        keys = (
            "step",
            "count",
            "reward_mean",
            "reward_min",
            "reward_max",
            "length_mean",
            "errors",
            "truncated",
        )
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def distinct(self, column: Literal["env", "status", "error_class", "tool"]) -> list[str]:
        """The values a filter column takes (for the UI's drop-downs).

        A skip scan over the column's index: one index seek per distinct value.
        """
        table, col = ("traj_tools", "tool") if column == "tool" else ("trajectories", column)
        if column not in ("env", "status", "error_class", "tool"):
            raise ValueError(f"column={column!r}: expected env, status, error_class or tool")
        sql = (
            f"WITH RECURSIVE d(v) AS (SELECT min({col}) FROM {table} UNION ALL "
            f"SELECT (SELECT min({col}) FROM {table} WHERE {col} > d.v) FROM d WHERE d.v IS NOT NULL) "
            "SELECT v FROM d WHERE v IS NOT NULL"
        )
        with self._lock:
            return [r[0] for r in self._db.execute(sql).fetchall()]

    def integrity_check(self) -> str:
        """SQLite's PRAGMA integrity_check ("ok" for a sound file)."""
        with self._lock:
            rows = self._db.execute("PRAGMA integrity_check").fetchall()
        return "\n".join(r[0] for r in rows)

    # -- export ------------------------------------------------------------

    def export_jsonl(self, path: str | Path) -> int:
        """One JSON object per trajectory (see agentrl.export); returns the row count."""
        from agentrl.export import export_jsonl

        return export_jsonl(self, path)

    def export_parquet(self, path: str | Path) -> int:
        """One Parquet row per trajectory (needs pyarrow); returns the row count."""
        from agentrl.export import export_parquet

        return export_parquet(self, path)


def resolve_store_path(path: str | Path) -> Path:
    """A run directory -> its store file; a file path is used as is."""
    p = Path(path)
    if p.is_dir() or (not p.suffix and not p.exists()):
        return p / STORE_FILENAME
    return p


# ---------------------------------------------------------------------------
# helpers


_STEP_STATS_UPSERT = """
INSERT INTO step_stats VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(step) DO UPDATE SET
    count = count + 1,
    rewards = rewards + excluded.rewards,
    reward_sum = reward_sum + excluded.reward_sum,
    reward_min = min(coalesce(reward_min, excluded.reward_min), coalesce(excluded.reward_min, reward_min)),
    reward_max = max(coalesce(reward_max, excluded.reward_max), coalesce(excluded.reward_max, reward_max)),
    tokens_sum = tokens_sum + excluded.tokens_sum,
    errors = errors + excluded.errors,
    truncated = truncated + excluded.truncated
"""


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


def _summary(row: Sequence[Any]) -> dict[str, JSON]:
    d = dict(zip(_SUMMARY_COLUMNS, row, strict=True))
    d["terminated"] = bool(d["terminated"])
    d["truncated"] = bool(d["truncated"])
    d["tools"] = json.loads(d["tools"])
    return d


def _preview(traj: Trajectory, limit: int = 160) -> str:
    """First user message and last assistant message, shortened, for list rows."""
    user = next((m.content for m in traj.messages if m.role == "user"), "")
    last = next((m.content for m in reversed(traj.messages) if m.role == "assistant"), "")

    def cut(s: str) -> str:
        s = " ".join(s.split())
        return s if len(s) <= limit else s[: limit - 1] + "…"

    return cut(user) + (" ⟶ " + cut(last) if last else "")


def _search_text(traj: Trajectory) -> str:
    parts: list[str] = []
    for m in traj.messages:
        parts.append(m.content)
        for c in m.tool_calls:
            parts.append(c.name)
            parts.append(json.dumps(c.arguments, ensure_ascii=False))
    if traj.error:
        parts.append(traj.error.message)
    return "\n".join(parts)


def _encode_cursor(key: Any, seq: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([key, seq]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[Any, int]:
    try:
        key, seq = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(seq, int) or not (key is None or isinstance(key, int | float)):
            raise ValueError
        return key, seq
    except (ValueError, TypeError):
        raise ValueError(f"cursor={cursor!r} is not valid: pass back a next_cursor you were given") from None


def _after(column: str | None, desc: bool, key: Any, seq: int) -> tuple[str, list[Any]]:
    """SQL for "rows after (key, seq)" in ORDER BY column, seq (NULLs sort first)."""
    op = "<" if desc else ">"
    if column is None:
        return f"t.seq {op} ?", [seq]
    c = f"t.{column}"
    if key is None:
        # inside the NULL block by seq, then (ascending) every non-NULL value
        sql = f"({c} IS NULL AND t.seq {op} ?)"
        return (sql, [seq]) if desc else (f"({sql} OR {c} IS NOT NULL)", [seq])
    sql = f"({c} {op} ? OR ({c} = ? AND t.seq {op} ?))"
    return (f"({sql} OR {c} IS NULL)", [key, key, seq]) if desc else (sql, [key, key, seq])
