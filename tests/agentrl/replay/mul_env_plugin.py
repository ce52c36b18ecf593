"""A tiny deterministic env used by the re-execution tests (a user plugin module).

The model may call `multiply(x, y)`; an answer `Answer: N` ends the episode
with reward 1 if right, plus `bonus` if the tool was used before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.registry import env as register_env
from agentrl.types import Message


class MulConfig(EnvConfig):
    bonus: float = 0.0


@register_env("mul")
class MulEnv(Env):
    """Multiply two numbers, optionally with a tool."""

    Config = MulConfig

    def __init__(self, config: MulConfig | None = None) -> None:
        super().__init__(config)
        self._task: Task = {}
        self._used_tool = False

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return [{"id": f"mul-{a}-{b}", "a": a, "b": b} for a in range(2, 5) for b in range(2, 5)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self._task = task
        self._used_tool = False
        return [Message("user", f"What is {task['a']} times {task['b']}? (seed {seed})")], {}

    async def step(self, action: Message) -> StepResult:
        if action.tool_calls:
            self._used_tool = True
            out = [
                Message("tool", str(c.arguments["x"] * c.arguments["y"]), tool_call_id=c.id, name=c.name)
                for c in action.tool_calls
            ]
            return StepResult(out, reward=0.0)
        m = re.search(r"Answer:\s*(-?\d+)", action.content)
        correct = m is not None and int(m.group(1)) == self._task["a"] * self._task["b"]
        bonus = float(self.config.bonus) if self._used_tool else 0.0  # type: ignore[attr-defined]
        return StepResult([], reward=(1.0 + bonus) if correct else 0.0, terminated=True)
