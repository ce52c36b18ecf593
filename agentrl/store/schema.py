"""The SQLite layout of a trajectory store: tables, the per-token array codec, migrations.

Tables (see `SCHEMA`):
- `trajectories`: one narrow row per trajectory with the columns the replay UI
  filters and sorts on, each indexed together with `seq` (insertion order), so
  a filtered page is an index range scan even with 100k rows; its counts,
  tools and preview describe the episode, not the prompt (`store_summary`);
- `trajectory_data`: the payload, kept apart so list queries never read it:
  the four per-token arrays as compact typed blobs (`encode_array`) and
  everything else of the trajectory as JSON;
- `traj_tools` (tools the episode called), `traj_policies` (the policies that
  sampled its turns, or played its agent: `trajectory_policies`), `traj_fts` (FTS5 full-text index
  over the task's question and the episode), `step_stats` (per-step reward,
  success, length, error counts of the non-eval trajectories), `groups` (with
  each group's task-stream position: the resume cursors), `metrics` (per
  step), `meta` (run config, schema version) and `state` (other run state a
  restart reads back, e.g. eval summaries).

Schema versions: 1 counted, previewed and indexed every message (few-shot
demonstrations included) and mixed eval trajectories into `step_stats`; 2 is
this layout. `migrate` upgrades a version-1 file in place, in one transaction,
recomputing only derived columns and indexes from the stored documents: no
stored trajectory changes. `traj_policies` came later without a version bump: a
version-2 file without it gets it (filled from the stored documents,
`backfill_policies`) the first time it is opened for writing; read-only, the
replay queries read such a file's policies from the documents themselves.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from agentrl.store.summary import summarize
from agentrl.types import Trajectory

STORE_SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions a read-only store opens: their documents and arrays are the same."""

SUMMARY_COLUMNS = (
    "seq", "id", "group_id", "sample_index", "task_id", "env", "step", "status", "reward",
    "terminated", "truncated", "error_class", "num_tokens", "num_sampled", "num_turns",
    "num_tool_calls", "tools", "version_min", "version_max", "preview", "created_at",
)  # fmt: skip

SUCCESS_REWARD = 1.0
"""A trajectory succeeded when its reward is at least this (as `eval/pass@k` counts)."""

_STEP_STATS = """
CREATE TABLE IF NOT EXISTS step_stats (
    step INTEGER PRIMARY KEY, count INTEGER NOT NULL, rewards INTEGER NOT NULL, reward_sum REAL NOT NULL,
    reward_min REAL, reward_max REAL, tokens_sum INTEGER NOT NULL, errors INTEGER NOT NULL,
    truncated INTEGER NOT NULL, successes INTEGER NOT NULL
)"""
_FTS = """
CREATE VIRTUAL TABLE IF NOT EXISTS traj_fts USING fts5(
    text, content='', tokenize='unicode61 remove_diacritics 2'
)"""

SCHEMA = f"""
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
CREATE TABLE IF NOT EXISTS traj_policies (
    policy TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (policy, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS traj_policies_seq ON traj_policies(seq);
{_STEP_STATS};
CREATE TABLE IF NOT EXISTS metrics (
    step INTEGER NOT NULL, key TEXT NOT NULL, value REAL, PRIMARY KEY (step, key)
) WITHOUT ROWID;
{_FTS};
"""

STEP_STATS_UPSERT = """
INSERT INTO step_stats VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(step) DO UPDATE SET
    count = count + 1,
    rewards = rewards + excluded.rewards,
    reward_sum = reward_sum + excluded.reward_sum,
    reward_min = min(coalesce(reward_min, excluded.reward_min), coalesce(excluded.reward_min, reward_min)),
    reward_max = max(coalesce(reward_max, excluded.reward_max), coalesce(excluded.reward_max, reward_max)),
    tokens_sum = tokens_sum + excluded.tokens_sum,
    errors = errors + excluded.errors,
    truncated = truncated + excluded.truncated,
    successes = successes + excluded.successes
"""

STEP_STATS_RECOUNT = f"""
INSERT INTO step_stats SELECT step, count(*), count(reward), coalesce(sum(reward), 0.0), min(reward),
    max(reward), sum(num_tokens), sum(error_class IS NOT NULL), sum(truncated), sum(reward >= {SUCCESS_REWARD})
FROM trajectories WHERE step IS NOT NULL AND status != 'eval' {{where}} GROUP BY step
"""
"""Recount `step_stats` rows from the trajectories; `{where}` narrows the steps (`AND step = ?`)."""


def create(db: sqlite3.Connection, now: float) -> None:
    """Create the tables of a new store, or upgrade an older one, inside the caller's transaction."""
    had_policies = has_table(db, "traj_policies")
    for statement in SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    row = db.execute("SELECT value FROM meta WHERE key='store_schema_version'").fetchone()
    if row is None:
        db.execute(
            "INSERT INTO meta VALUES ('store_schema_version', ?), ('created_at', ?)",
            (str(STORE_SCHEMA_VERSION), repr(now)),
        )
    elif int(row[0]) == 1:
        migrate(db)
    elif not had_policies:
        backfill_policies(db)


def has_table(db: sqlite3.Connection, name: str) -> bool:
    return (
        db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
        is not None
    )


def doc_policies(doc: Mapping[str, Any]) -> list[str]:
    """The policies of a stored trajectory document, as `trajectory_policies` says."""
    names = [t.get("policy") for t in doc.get("turns") or () if isinstance(t, dict)]
    info = doc.get("info")
    names.append(info.get("policy") if isinstance(info, dict) else None)
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def trajectory_policies(traj: Trajectory) -> list[str]:
    """The policies a trajectory belongs to (what the replay's policy filter matches): those that
    sampled its turns (`Turn.policy`, in order of first turn), then the one that played its agent
    (`info["policy"]`, multi-agent episodes). Empty in a single-policy run."""
    policy = traj.info.get("policy")
    names = [*traj.policies, *([policy] if isinstance(policy, str) and policy else [])]
    return list(dict.fromkeys(names))


def backfill_policies(db: sqlite3.Connection, batch_size: int = 512) -> int:
    """Fill `traj_policies` from the stored documents (a file written before the table existed);
    returns the rows added. Documents are not touched."""
    added, last = 0, 0
    while True:
        rows = db.execute(
            "SELECT seq, doc FROM trajectory_data WHERE seq > ? ORDER BY seq LIMIT ?", (last, batch_size)
        ).fetchall()
        if not rows:
            return added
        pairs = [(p, seq) for seq, doc in rows for p in doc_policies(json.loads(doc))]
        db.executemany("INSERT OR IGNORE INTO traj_policies VALUES (?, ?)", pairs)
        added += len(pairs)
        last = rows[-1][0]


def version(db: sqlite3.Connection) -> int | None:
    """The file's store schema version (None: not a store, or an empty file)."""
    row = db.execute("SELECT value FROM meta WHERE key='store_schema_version'").fetchone()
    return None if row is None else int(row[0])


def migrate(db: sqlite3.Connection, batch_size: int = 512) -> int:
    """Upgrade a version-1 store to version 2 inside the caller's transaction; returns the rows redone.

    Recomputes, from each stored document, the episode's counts, tools and
    preview, the tools table and the full-text index; recounts `step_stats`
    without eval trajectories. Documents and token arrays are not touched.
    """
    db.execute("DROP TABLE step_stats")
    db.execute(_STEP_STATS)
    db.execute("DROP TABLE traj_fts")
    db.execute(_FTS)
    db.execute("DELETE FROM traj_tools")
    db.execute("DELETE FROM traj_policies")
    done, last = 0, 0
    while True:
        rows = db.execute(
            "SELECT seq, doc FROM trajectory_data WHERE seq > ? ORDER BY seq LIMIT ?", (last, batch_size)
        ).fetchall()
        if not rows:
            break
        for seq, doc_text in rows:
            doc = json.loads(doc_text)
            # the summary reads messages only: no need to decode the token arrays
            doc.update(token_ids=[], loss_mask=[], logprobs=[], versions=[])
            s = summarize(Trajectory.from_dict(doc))
            db.execute(
                "UPDATE trajectories SET num_turns = ?, num_tool_calls = ?, tools = ?, preview = ? WHERE seq = ?",
                (s.num_turns, s.num_tool_calls, json.dumps(s.tools), s.preview, seq),
            )
            db.executemany("INSERT INTO traj_tools VALUES (?, ?)", [(t, seq) for t in s.tools])
            db.executemany(
                "INSERT OR IGNORE INTO traj_policies VALUES (?, ?)", [(p, seq) for p in doc_policies(doc)]
            )
            db.execute("INSERT INTO traj_fts (rowid, text) VALUES (?, ?)", (seq, s.search_text))
        done += len(rows)
        last = rows[-1][0]
    db.execute(STEP_STATS_RECOUNT.format(where=""))
    db.execute("UPDATE meta SET value = ? WHERE key = 'store_schema_version'", (str(STORE_SCHEMA_VERSION),))
    return done


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
        arr = array(code, values)
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
