"""`reasoning_gym`: any reasoning-gym procedural dataset as a single-turn env.

The question is the user message; the model answers inside `<answer>...</answer>`
(reasoning-gym's own convention) and the dataset's own `score_answer` gives the
reward, so partial credit is whatever the dataset defines. Splits come from one
seeded generator: train is the first `train_size` items, test the next
`test_size` items minus any whose question also occurs in train, so held-out
questions are never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message


def default_system_prompt(tag: str = "answer") -> str:
    """The default instructions, asking for the answer inside <tag></tag>."""
    return (
        f"Think step by step, then give only the final answer inside <{tag}></{tag}> tags, "
        f"for example <{tag}>42</{tag}>."
    )


DEFAULT_SYSTEM_PROMPT = default_system_prompt()


class ReasoningGymConfig(EnvConfig):
    """Config of the `reasoning_gym` env."""

    dataset: str = Field("basic_arithmetic", description="reasoning-gym dataset name")
    dataset_params: dict[str, JSON] = Field(
        default_factory=dict, description="keyword arguments of the dataset's own config"
    )
    seed: int = Field(0, description="generator seed; same seed -> same tasks")
    train_size: int = Field(1000, ge=1, description="train tasks: the generator's first train_size items")
    test_size: int = Field(
        100, ge=0, description="items after train for test, less any whose question is in train; 0 = none"
    )
    system_prompt: str | None = Field(
        default=DEFAULT_SYSTEM_PROMPT, description="None: no system message; the default asks for answer_tag"
    )
    answer_tag: str = Field(
        default="answer",
        pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$",
        description="tag the answer is read from (answer -> <answer>...</answer>)",
    )

    @model_validator(mode="after")
    def _prompt_asks_for_the_tag(self) -> ReasoningGymConfig:
        """With the default prompt, another answer_tag must change what the prompt asks for too."""
        if "system_prompt" not in self.model_fields_set:
            self.system_prompt = default_system_prompt(self.answer_tag)
        return self

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            import difflib

            close = difflib.get_close_matches(name, list(DATASETS), n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise ValueError(
                f"dataset={name!r} is not a reasoning-gym dataset ({len(DATASETS)} available{hint})"
            )
        return name


class ReasoningGymEnv(Env[ReasoningGymConfig]):
    """One reasoning-gym question per episode, scored by the dataset's own scorer."""

    name: ClassVar[str] = "reasoning_gym"
    description: ClassVar[str] = "Any reasoning-gym dataset by name; reward from its own scorer"

    def __init__(self, config: ReasoningGymConfig | None = None) -> None:
        super().__init__(config)
        self._dataset: Any = None
        self._test_indices: list[int] | None = None
        self._task: Task | None = None

    def _data(self) -> Any:
        """The seeded generator holding train and test items (built once, on first use)."""
        if self._dataset is None:
            import reasoning_gym

            size = self.config.train_size + self.config.test_size
            try:
                self._dataset = reasoning_gym.create_dataset(
                    self.config.dataset, seed=self.config.seed, size=size, **self.config.dataset_params
                )
            except TypeError as e:  # unknown dataset_params key
                raise ValueError(f"dataset_params for {self.config.dataset!r}: {e}") from e
        return self._dataset

    def _indices(self, split: str) -> list[int]:
        if split == "train":
            return list(range(self.config.train_size))
        if split == "test":
            if self._test_indices is None:
                data = self._data()
                seen = {data[i]["question"] for i in range(self.config.train_size)}
                end = self.config.train_size + self.config.test_size
                self._test_indices = [
                    i for i in range(self.config.train_size, end) if data[i]["question"] not in seen
                ]
            return self._test_indices
        raise ValueError(f"split={split!r} is not a split of reasoning_gym (allowed: train, test)")

    def tasks(self, split: str = "train") -> Iterable[Task]:
        data = self._data()
        for i in self._indices(split):
            entry = data[i]
            yield {
                "id": f"{self.config.dataset}/s{self.config.seed}/{i}",
                "split": split,
                "index": i,
                "question": entry["question"],
                "answer": _jsonable(entry["answer"]),
            }

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        if "question" not in task or "index" not in task:
            raise ValueError(f"reasoning_gym task needs 'question' and 'index', got keys {sorted(task)}")
        self._task = task
        messages = [Message(role="user", content=str(task["question"]))]
        if self.config.system_prompt is not None:
            messages.insert(0, Message(role="system", content=self.config.system_prompt))
        return messages, {"dataset": self.config.dataset}

    async def step(self, action: Message) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() called before reset()")
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action.content, tag_name=self.config.answer_tag)
        if answer is None:
            return StepResult(messages=[], reward=0.0, terminated=True, info={"format_error": True})
        entry = self._data()[int(self._task["index"])]
        score = float(self._data().score_answer(answer, entry) or 0.0)
        return StepResult(messages=[], reward=score, terminated=True, info={"answer": answer, "score": score})


def _jsonable(value: Any) -> JSON:
    """reasoning-gym answers are usually strings; anything else via a JSON round-trip."""
    if isinstance(value, str):
        return value
    return json.loads(json.dumps(value, default=str))
