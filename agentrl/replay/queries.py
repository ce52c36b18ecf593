"""The replay UI's questions to a trajectory store: filters, full-text search, pages, groups, per-step stats.

Training never imports this module: it writes and resumes through
`agentrl.store.trajectory_store.TrajectoryStore`; this is the read model over the same tables
(`agentrl.store.schema`) for the inspector, `agentrl show` and notebooks:

    with TrajectoryQueries.open("runs/calculator") as q:
        page, cursor = q.page(TrajectoryFilter(env="calculator", reward_max=0.0), limit=20)
        traj = q.store.get_trajectory(page[0]["id"])
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from agentrl.store.schema import STORE_SCHEMA_VERSION, SUMMARY_COLUMNS, doc_policies
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import JSON

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
DistinctColumn = Literal["env", "status", "error_class", "tool", "policy"]

_COLUMNS = ", ".join("t." + c for c in SUMMARY_COLUMNS)


@dataclass(frozen=True, slots=True)
class TrajectoryFilter:
    """What the trajectory list may be filtered on; every field is optional.

    `error` is an ErrorClass value ("env", "tool", ...), "none" (no error) or
    "any" (any error). `tool` matches trajectories whose episode called that
    tool. `search` is full text over the task's question and the episode (not
    the system prompt or demonstrations; words, all must match; `word*` for a
    prefix); quotes and FTS operators in it are taken literally. `policy`
    matches the trajectories of that policy of a multi-policy run: it sampled
    one of their turns or played their agent (`store.schema.trajectory_policies`).
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
    policy: str | None = None

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

    def where(self, *, policies_table: bool = True) -> tuple[str, list[Any]]:
        """The SQL WHERE clause (over `trajectories t`) and its parameters.

        With a full-text search the FTS match list drives the query: the other
        columns are written `+t.col` so SQLite does not pick their index and
        then sort every candidate (a few ms instead of ~100 ms at 100k rows).
        A policy is looked up in the `traj_policies` index; `policies_table=False`
        (a store written before that table existed, opened read-only) reads the
        stored documents instead (a scan).
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
        if self.policy is not None:
            clauses.append(
                "t.seq IN (SELECT seq FROM traj_policies WHERE policy = ?)"
                if policies_table
                else f"t.seq IN (SELECT d.seq FROM trajectory_data d WHERE {_DOC_HAS_POLICY})"
            )
            args.extend([self.policy] * (1 if policies_table else 2))
        if match:
            clauses.append("t.seq IN (SELECT rowid FROM traj_fts WHERE traj_fts MATCH ?)")
            args.append(match)
        return (" AND ".join(clauses) if clauses else "1"), args


_DOC_HAS_POLICY = (
    "EXISTS (SELECT 1 FROM json_each(d.doc, '$.turns') j WHERE json_extract(j.value, '$.policy') = ?) "
    "OR json_extract(d.doc, '$.info.policy') = ?"
)
"""A stored document is of a policy (what `traj_policies` holds), for files without that table."""


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


class TrajectoryQueries:
    """Read queries over one store. `open(path)` makes one that owns a read-only store.

    A store written by an older agentrl (schema version 1) is refused with a
    message saying how to upgrade it: its counts, previews and search index
    still include the prompt (`agentrl.store.trajectory_store.upgrade_store` redoes them).
    """

    def __init__(self, store: TrajectoryStore, *, owns_store: bool = False) -> None:
        if store.schema_version != STORE_SCHEMA_VERSION:
            if owns_store:
                store.close()
            raise ValueError(
                f"{store.path} was written by an older agentrl (store schema {store.schema_version}): "
                "upgrade it once with `agentrl replay` or `agentrl.store.trajectory_store.upgrade_store(path)`"
            )
        self.store = store
        self._owns_store = owns_store
        self._policies_table = False

    @classmethod
    def open(cls, path: str | Path) -> TrajectoryQueries:
        return cls(TrajectoryStore(path, readonly=True), owns_store=True)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> TrajectoryQueries:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

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
        where, args = self._where(filters)
        if cursor:
            key, seq = _decode_cursor(cursor)
            sql, more = _after(column, desc, key, seq)
            where += " AND " + sql
            args += more
        direction = "DESC" if desc else "ASC"
        order_by = f"t.{column} {direction}, t.seq {direction}" if column else f"t.seq {direction}"
        sql = f"SELECT {_COLUMNS} FROM trajectories t WHERE {where} ORDER BY {order_by} LIMIT ? OFFSET ?"
        rows = self.store.read(sql, [*args, limit + 1, offset])
        items = self._summaries(rows[:limit])
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            next_cursor = _encode_cursor(last[column] if column else None, int(last["seq"]))
        return items, next_cursor

    def count(self, filters: TrajectoryFilter | None = None) -> int:
        where, args = self._where(filters)
        return int(self.store.read(f"SELECT count(*) FROM trajectories t WHERE {where}", args)[0][0])

    def group(self, group_id: str) -> dict[str, JSON] | None:
        """The group row (task, step, status, reward mean/std) or None."""
        keys = ("id", "task_id", "step", "status", "size", "reward_mean", "reward_std", "task", "created_at")
        rows = self.store.read(f"SELECT {', '.join(keys)} FROM groups WHERE id = ?", (group_id,))
        if not rows:
            return None
        out = dict(zip(keys, rows[0], strict=True))
        out["task"] = json.loads(out["task"])
        return out

    def group_members(self, group_id: str) -> list[dict[str, JSON]]:
        """Summaries of a group's trajectories, by sample index."""
        rows = self.store.read(
            f"SELECT {_COLUMNS} FROM trajectories t WHERE t.group_id = ? ORDER BY t.sample_index, t.seq",
            (group_id,),
        )
        return self._summaries(rows)

    def step_rewards(self) -> list[dict[str, JSON]]:
        """Per step, over its non-eval trajectories: count, mean/min/max reward, success rate, mean length,
        errors, truncations.

        Kept up to date on every insert (table `step_stats`), so the overview
        costs one row per step, not a scan of every trajectory. `success_rate`
        is the share with reward >= 1 (what `eval/pass@1` counts on eval tasks).
        """
        rows = self.store.read(
            "SELECT step, count, CASE WHEN rewards > 0 THEN reward_sum / rewards END, reward_min, reward_max, "
            "CAST(successes AS REAL) / count, CAST(tokens_sum AS REAL) / count, errors, truncated "
            "FROM step_stats ORDER BY step"
        )
        keys = ("step", "count", "reward_mean", "reward_min", "reward_max", "success_rate", "length_mean",
                "errors", "truncated")  # fmt: skip
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def distinct(self, column: DistinctColumn) -> list[str]:
        """The values a filter column takes (for the UI's drop-downs).

        A skip scan over the column's index: one index seek per distinct value.
        """
        if column not in ("env", "status", "error_class", "tool", "policy"):
            raise ValueError(f"column={column!r}: expected env, status, error_class, tool or policy")
        if column == "policy" and not self._has_policies_table():
            return sorted({p for (doc,) in self.store.read("SELECT doc FROM trajectory_data") for p in
                           doc_policies(json.loads(doc))})  # fmt: skip
        table, col = {"tool": ("traj_tools", "tool"), "policy": ("traj_policies", "policy")}.get(
            column, ("trajectories", column)
        )
        sql = (
            f"WITH RECURSIVE d(v) AS (SELECT min({col}) FROM {table} UNION ALL "
            f"SELECT (SELECT min({col}) FROM {table} WHERE {col} > d.v) FROM d WHERE d.v IS NOT NULL) "
            "SELECT v FROM d WHERE v IS NOT NULL"
        )
        return [r[0] for r in self.store.read(sql)]

    def _has_policies_table(self) -> bool:
        """Whether the file has `traj_policies` (asked again until it has: a writer may add it)."""
        if not self._policies_table:
            self._policies_table = bool(
                self.store.read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'traj_policies'")
            )
        return self._policies_table

    def _where(self, filters: TrajectoryFilter | None) -> tuple[str, list[Any]]:
        f = filters or TrajectoryFilter()
        return f.where(policies_table=f.policy is None or self._has_policies_table())

    def _summaries(self, rows: Sequence[Sequence[Any]]) -> list[dict[str, JSON]]:
        """List rows, each with its `policies` (empty in a single-policy run; a seek per row by seq)."""
        items = [_summary(r) for r in rows]
        if not items:
            return items
        seqs = [int(str(item["seq"])) for item in items]
        marks = ", ".join("?" * len(seqs))
        by_seq: dict[int, list[str]] = {}
        if self._has_policies_table():
            found = self.store.read(f"SELECT seq, policy FROM traj_policies WHERE seq IN ({marks})", seqs)
            for seq, policy in found:
                by_seq.setdefault(seq, []).append(policy)
        else:
            for seq, doc in self.store.read(
                f"SELECT seq, doc FROM trajectory_data WHERE seq IN ({marks})", seqs
            ):
                by_seq[seq] = doc_policies(json.loads(doc))
        for item, seq in zip(items, seqs, strict=True):
            item["policies"] = list(by_seq.get(seq, []))
        return items


def _summary(row: Sequence[Any]) -> dict[str, JSON]:
    d = dict(zip(SUMMARY_COLUMNS, row, strict=True))
    d["terminated"] = bool(d["terminated"])
    d["truncated"] = bool(d["truncated"])
    d["tools"] = json.loads(d["tools"])
    return d


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
