"""Export a run's trajectories for the Hugging Face `datasets` world.

One row per trajectory, the same columns in JSONL and Parquet, shaped so that
`datasets.load_dataset("json" | "parquet", data_files=...)` infers one schema
for every row: the fixed parts are typed columns (ids, flags, token arrays,
messages with their tool calls), the free-form dicts whose keys vary from row
to row (task, info, metrics, reward breakdown, tool-call arguments, turn info)
are JSON strings. `prompt_messages` says how many leading messages were the
prompt (null in rows of trajectories that did not record it; see
`agentrl.store.summary.prompt_length`). `row_to_trajectory` turns a row back
into a Trajectory.

JSON has no NaN/inf: in JSONL a non-finite reward or logprob is written as
null (Parquet keeps the value).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.types import JSON, EpisodeError, Message, ToolCall, Trajectory, Turn

if TYPE_CHECKING:
    from agentrl.store.trajectory_store import StoredTrajectory, TrajectoryStore


def trajectory_row(record: StoredTrajectory) -> dict[str, JSON]:
    """The export row of one stored trajectory."""
    t = record.trajectory
    return {
        "id": t.id,
        "schema_version": t.schema_version,
        "step": record.step,
        "status": record.status,
        "task_id": t.task_id,
        "env": t.env,
        "group_id": t.group_id,
        "sample_index": t.sample_index,
        "seed": t.seed,
        "reward": t.reward,
        "terminated": t.terminated,
        "truncated": t.truncated,
        "truncation_reason": t.truncation_reason,
        "error_class": t.error.kind.value if t.error else None,
        "error_message": t.error.message if t.error else None,
        "error_turn": t.error.turn if t.error else None,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "tool_calls": [
                    {"id": c.id, "name": c.name, "arguments": json.dumps(c.arguments), "error": c.error}
                    for c in m.tool_calls
                ],
                "tool_call_id": m.tool_call_id,
                "name": m.name,
            }
            for m in t.messages
        ],
        "prompt_messages": t.prompt_messages,
        "token_ids": list(t.token_ids),
        "loss_mask": list(t.loss_mask),
        "logprobs": list(t.logprobs),
        "versions": list(t.versions),
        "turns": [
            {
                "start": u.start,
                "end": u.end,
                "reward": u.reward,
                "tool_calls": list(u.tool_calls),
                "info": json.dumps(u.info),
            }
            for u in t.turns
        ],
        "reward_breakdown": json.dumps(t.reward_breakdown),
        "task": json.dumps(t.task),
        "metrics": json.dumps(t.metrics),
        "info": json.dumps(t.info),
    }


def row_to_trajectory(row: Mapping[str, Any]) -> Trajectory:
    """Inverse of `trajectory_row` (for a row read back from either format)."""

    def num(x: Any) -> float:
        return math.nan if x is None else float(x)

    error = None
    if row.get("error_class"):
        error = EpisodeError.from_dict(
            {"kind": row["error_class"], "message": row["error_message"], "turn": row.get("error_turn")}
        )
    return Trajectory(
        id=row["id"],
        task_id=row["task_id"],
        env=row["env"],
        group_id=row["group_id"],
        sample_index=row["sample_index"],
        seed=row["seed"],
        reward=num(row["reward"]),
        terminated=bool(row["terminated"]),
        truncated=bool(row["truncated"]),
        truncation_reason=row["truncation_reason"],
        error=error,
        messages=[
            Message(
                role=m["role"],
                content=m["content"],
                tool_calls=[
                    ToolCall(
                        name=c["name"], arguments=json.loads(c["arguments"]), id=c["id"], error=c["error"]
                    )
                    for c in m["tool_calls"] or []
                ],
                tool_call_id=m["tool_call_id"],
                name=m["name"],
            )
            for m in row["messages"]
        ],
        prompt_messages=row.get("prompt_messages"),
        token_ids=list(row["token_ids"]),
        loss_mask=list(row["loss_mask"]),
        logprobs=[num(x) for x in row["logprobs"]],
        versions=list(row["versions"]),
        turns=[
            Turn(
                start=u["start"],
                end=u["end"],
                reward=num(u["reward"]),
                tool_calls=list(u["tool_calls"] or []),
                info=json.loads(u["info"]),
            )
            for u in row["turns"] or []
        ],
        reward_breakdown=json.loads(row["reward_breakdown"]),
        task=json.loads(row["task"]),
        metrics=json.loads(row["metrics"]),
        info=json.loads(row["info"]),
    )


def _rows(store: TrajectoryStore) -> Iterator[dict[str, JSON]]:
    for record in store.iter_records():
        yield trajectory_row(record)


def export_jsonl(store: TrajectoryStore, path: str | Path) -> int:
    """Write every trajectory as one JSON line; returns the number of rows."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for row in _rows(store):
            row["reward"] = _finite(row["reward"])
            row["logprobs"] = [_finite(x) for x in row["logprobs"]]
            for u in row["turns"]:
                u["reward"] = _finite(u["reward"])
            f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
            n += 1
    return n


def export_parquet(store: TrajectoryStore, path: str | Path, *, batch_rows: int = 512) -> int:
    """Write every trajectory as one Parquet row (streamed in row groups); returns the count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    n = 0
    batch: list[dict[str, JSON]] = []
    with pq.ParquetWriter(str(path), schema) as writer:
        for row in _rows(store):
            batch.append(row)
            if len(batch) >= batch_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n += len(batch)
                batch = []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def parquet_schema() -> Any:
    """The Arrow schema of an export row."""
    import pyarrow as pa

    tool_call = pa.struct(
        [("id", pa.string()), ("name", pa.string()), ("arguments", pa.string()), ("error", pa.string())]
    )
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.list_(tool_call)),
            ("tool_call_id", pa.string()),
            ("name", pa.string()),
        ]
    )
    turn = pa.struct(
        [
            ("start", pa.int64()),
            ("end", pa.int64()),
            ("reward", pa.float64()),
            ("tool_calls", pa.list_(pa.string())),
            ("info", pa.string()),
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            ("schema_version", pa.int64()),
            ("step", pa.int64()),
            ("status", pa.string()),
            ("task_id", pa.string()),
            ("env", pa.string()),
            ("group_id", pa.string()),
            ("sample_index", pa.int64()),
            ("seed", pa.int64()),
            ("reward", pa.float64()),
            ("terminated", pa.bool_()),
            ("truncated", pa.bool_()),
            ("truncation_reason", pa.string()),
            ("error_class", pa.string()),
            ("error_message", pa.string()),
            ("error_turn", pa.int64()),
            ("messages", pa.list_(message)),
            ("prompt_messages", pa.int64()),
            ("token_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float64())),
            ("versions", pa.list_(pa.int64())),
            ("turns", pa.list_(turn)),
            ("reward_breakdown", pa.string()),
            ("task", pa.string()),
            ("metrics", pa.string()),
            ("info", pa.string()),
        ]
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
