"""The run's record: every trajectory in SQLite (WAL), written with the step's metrics and cursor.

- `trajectory_store`: `TrajectoryStore`, append-only writes, crash safety, upgrades.
- `schema`: the tables.
- `summary`: prompt length and the per-row summary the replay lists.
- `export`: JSONL/Parquet export and rows back into `Trajectory` objects.

No torch.
"""
