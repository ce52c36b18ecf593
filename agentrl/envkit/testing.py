"""Small real environments for tests, benchmarks and dry runs of the rollout loop.

`TrivialEnv` answers every reply with a short user message and ends after a
fixed number of turns (reward 1.0); an optional latency distribution per step
models tool or sandbox time. It measures the rollout machinery, not a task.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import Field

from agentrl.engines.scripted import Distribution
from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import Message


class TrivialEnvConfig(EnvConfig):
    turns: int = Field(default=4, ge=1, description="model turns per episode")
    num_tasks: int = Field(default=64, ge=1, description="tasks per split")
    step_latency_s: Distribution = Field(default_factory=Distribution, description="time one step takes")
    seed: int = Field(default=0, description="seed of the step-latency sampler (an episode seed reseeds it)")


class TrivialEnv(Env[TrivialEnvConfig]):
    """Replies "ok" to every turn; terminates after `turns` turns with reward 1.0."""

    name: ClassVar[str] = "trivial"
    description: ClassVar[str] = "a fixed number of turns, constant reward: for measuring the rollout loop"

    def __init__(self, config: TrivialEnvConfig | None = None) -> None:
        super().__init__(config)
        self._turn = 0
        self.steps = 0  # step() calls over the env's lifetime (benchmarks count env steps with it)
        self._rng_instance: random.Random | None = None  # made on first use: seeding costs ~6 us
        self._reply = [Message(role="user", content="ok")]
        self._latency = None if self.config.step_latency_s.is_zero else self.config.step_latency_s

    def _rng(self) -> random.Random:
        """The latency RNG, seeded with `config.seed` when first needed."""
        if self._rng_instance is None:
            self._rng_instance = random.Random(self.config.seed)
        return self._rng_instance

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return ({"id": f"{split}-{i}", "prompt": f"task {i}"} for i in range(self.config.num_tasks))

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self._turn = 0
        if seed is not None and self._latency is not None:
            self._rng().seed(seed)
        return [Message(role="user", content=str(task.get("prompt", "go")))], {}

    async def step(self, action: Message) -> StepResult:
        self.steps += 1
        if self._latency is not None:
            await asyncio.sleep(self._latency.sample(self._rng()))
        self._turn += 1
        if self._turn >= self.config.turns:
            return StepResult([], 1.0, True)
        return StepResult(self._reply)
