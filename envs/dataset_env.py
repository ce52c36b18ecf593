"""`dataset`: tasks from a Hugging Face `datasets` dataset or a local JSONL/JSON/Parquet/CSV file.

This is how users bring GSM8K-style data. `columns` maps task fields to
dataset columns (`{"question": "problem", "answer": "solution"}`), the
`prompt_template` (Python `str.format` over those fields) makes the user
message, and `rewards` names the verifier/reward plugins that score the reply
(default: the math verifier on `answer`). Single-turn by default; list tool
plugins in `tools` to let the model call them first (multi-turn; the episode
ends at the first reply without a tool call).

Task ids are the `id_column` value when given, else a content hash of the
mapped fields, so they survive re-ordering of the file. Without a separate
`test_source`, rows are split by hashing the id (`test_fraction`), so a row
stays in the same split when the file grows.
"""

from __future__ import annotations

import csv
import hashlib
import json
import string
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.env import Task
from agentrl.run.resources import RunResources
from agentrl.types import JSON, Message

from .reward_specs import NamedReward
from .tool_support import ToolCapableConfig, ToolCapableEnv

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class Source(BaseModel):
    """Where rows come from: a local file (`path`) or a hub/`datasets` dataset (`hf_name`)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="local .jsonl/.json/.parquet/.csv file")
    hf_name: str | None = Field(None, description="datasets.load_dataset name (e.g. 'openai/gsm8k')")
    hf_config: str | None = Field(None, description="hf_name only: dataset config/subset (e.g. 'main'); None: the default")
    hf_split: str = Field("train", description="hf_name only: split of the dataset to read")

    @model_validator(mode="after")
    def _one_source(self) -> Source:
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("give exactly one of `path` (local file) or `hf_name` (datasets name)")
        if self.path is not None and not self.path.endswith(LOCAL_SUFFIXES):
            raise ValueError(f"path={self.path!r}: supported file types are {', '.join(LOCAL_SUFFIXES)}")
        return self


class DatasetConfig(ToolCapableConfig):
    """Config of the `dataset` env."""

    source: Source = Field(description="rows of the train split (and of test too when test_source is unset)")
    test_source: Source | None = Field(None, description="held-out rows; else a hashed test_fraction")
    test_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="without test_source: share of rows hashed by id into test; 0 = no test"
    )
    columns: dict[str, str] = Field(
        default_factory=lambda: {"question": "question", "answer": "answer"},
        description="task field -> dataset column",
    )
    id_column: str | None = Field(None, description="column holding the task id; None: a hash of the mapped fields")
    prompt_template: str = Field("{question}", description="str.format template over `columns` keys: the user message")
    system_prompt: str | None = Field(None, description="system message of each episode; None: no system message")
    max_tasks: int | None = Field(None, ge=1, description="cap per split (first rows in file order)")

    @model_validator(mode="after")
    def _template_uses_known_fields(self) -> DatasetConfig:
        fields = {name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name}
        unknown = {f.split(".")[0].split("[")[0] for f in fields} - set(self.columns)
        if unknown:
            raise ValueError(
                f"prompt_template uses {sorted(unknown)}, which are not keys of `columns` "
                f"(available: {sorted(self.columns)})"
            )
        return self


class DatasetEnv(ToolCapableEnv[DatasetConfig]):
    """Rows of a dataset as tasks; the reply is scored by the configured reward plugins."""

    name: ClassVar[str] = "dataset"
    description: ClassVar[str] = "Tasks from an HF dataset or local JSONL/Parquet, scored by chosen verifiers"

    def __init__(
        self,
        config: DatasetConfig | None = None,
        *,
        rewards: Sequence[NamedReward] | None = None,
        plugins: Any = None,
        resources: RunResources | None = None,
    ) -> None:
        super().__init__(config, rewards=rewards, plugins=plugins, resources=resources)
        self._tasks: dict[str, list[Task]] = {}

    # -- tasks --------------------------------------------------------------

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is not a split of dataset (allowed: train, test)")
        if split not in self._tasks:
            self._tasks[split] = self._load_split(split)
        return iter(self._tasks[split])

    def _load_split(self, split: str) -> list[Task]:
        if self.config.test_source is not None:
            source = self.config.source if split == "train" else self.config.test_source
            tasks = self._to_tasks(read_rows(source), split)
        else:
            tasks = [t for t in self._to_tasks(read_rows(self.config.source), split) if _split_of(t["id"], self.config.test_fraction) == split]
        return tasks[: self.config.max_tasks] if self.config.max_tasks else tasks

    def _to_tasks(self, rows: Iterable[dict[str, Any]], split: str) -> list[Task]:
        out: list[Task] = []
        seen: set[str] = set()
        for n, row in enumerate(rows):
            task: Task = {}
            for field, column in self.config.columns.items():
                if column not in row:
                    raise ValueError(
                        f"columns.{field}={column!r}: row {n} has no such column (it has: {sorted(row)})"
                    )
                task[field] = _jsonable(row[column])
            if self.config.id_column is not None:
                if self.config.id_column not in row:
                    raise ValueError(f"id_column={self.config.id_column!r}: row {n} has no such column")
                task_id = str(row[self.config.id_column])
            else:
                task_id = hashlib.sha1(json.dumps(task, sort_keys=True).encode()).hexdigest()[:16]
            if task_id in seen:  # an exact duplicate row (or a repeated id): keep the first
                continue
            seen.add(task_id)
            task["id"] = task_id
            task["split"] = split
            task["prompt"] = self.config.prompt_template.format(**task)
            out.append(task)
        return out

    # -- episode ------------------------------------------------------------

    def initial_messages(self, task: Task) -> list[Message]:
        if "prompt" not in task:
            raise ValueError(f"dataset task needs a 'prompt' field, got keys {sorted(task)}")
        messages = [Message(role="user", content=str(task["prompt"]))]
        if self.config.system_prompt is not None:
            messages.insert(0, Message(role="system", content=self.config.system_prompt))
        return messages


def read_rows(source: Source) -> Iterator[dict[str, Any]]:
    """Rows of a source as dicts, in file/dataset order."""
    if source.hf_name is not None:
        import datasets

        yield from datasets.load_dataset(source.hf_name, source.hf_config, split=source.hf_split)
        return
    assert source.path is not None
    path = Path(source.path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"source.path={source.path!r}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            yield from csv.DictReader(f)
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"source.path={source.path!r}: a .json file must hold a list of objects")
        yield from data
    else:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{source.path}:{lineno}: not valid JSON ({e.msg})") from e


def _split_of(task_id: str, test_fraction: float) -> str:
    bucket = int(hashlib.sha1(task_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if bucket < test_fraction else "train"


def _jsonable(value: Any) -> JSON:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.loads(json.dumps(value, default=str))
