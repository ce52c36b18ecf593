"""The `hello` env: the model must greet a person by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import Message


class HelloConfig(EnvConfig):
    names: list[str] = Field(default_factory=lambda: ["Ada", "Alan", "Grace"])


class HelloEnv(Env):
    """Greet the person by name; reward 1 when the reply contains the name."""

    Config = HelloConfig

    def tasks(self, split: str = "train") -> Iterable[Task]:
        assert isinstance(self.config, HelloConfig)
        return [{"id": f"{split}-{i}", "person": n} for i, n in enumerate(self.config.names)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self._person = task["person"]
        return [Message(role="user", content=f"Say hello to {self._person}.")], {}

    async def step(self, action: Message) -> StepResult:
        reward = 1.0 if self._person.lower() in action.content.lower() else 0.0
        return StepResult(messages=[], reward=reward, terminated=True)
