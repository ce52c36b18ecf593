"""A tiny deterministic env used by the re-execution tests (a user plugin module).

Also records episodes for the tests (`record_mul_episode`). The model may call `multiply(x, y)`; an answer `Answer: N` ends the episode
with reward 1 if right, plus `bonus` if the tool was used before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.registry import env as register_env
from agentrl.types import Message, ToolCall, Trajectory, Turn


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


def tokenise(
    tok: SimpleChatTokenizer, messages: list[Message]
) -> tuple[list[int], list[int], list[float], list[int], list[Turn]]:
    ids: list[int] = []
    mask: list[int] = []
    turns: list[Turn] = []
    head = len(tok.encode("<|im_start|>assistant\n"))  # the generation prompt is not sampled
    for m in messages:
        part = tok.encode(tok.render([m]))
        if m.role == "assistant":
            turns.append(Turn(start=len(ids) + head, end=len(ids) + len(part)))
            mask += [0] * head + [1] * (len(part) - head)
        else:
            mask += [0] * len(part)
        ids += part
    logprobs = [-0.5 if k else 0.0 for k in mask]
    versions = [1 if k else -1 for k in mask]
    return ids, mask, logprobs, versions, turns


async def record_mul_episode(traj_id: str, a: int, b: int) -> Trajectory:
    """Run the real `mul` env with scripted assistant messages and record the episode."""
    env = MulEnv(MulEnv.Config(bonus=0.5))
    task = {"id": f"mul-{a}-{b}", "a": a, "b": b}
    messages, _ = await env.reset(task, seed=7)
    actions = [
        Message(
            "assistant", "I will use the tool.", tool_calls=[ToolCall("multiply", {"x": a, "y": b}, id="c1")]
        ),
        Message("assistant", f"Answer: {a * b}"),
    ]
    total = 0.0
    turn_rewards = []
    for action in actions:
        messages.append(action)
        result = await env.step(action)
        messages += result.messages
        total += result.reward
        turn_rewards.append(result.reward)
    tok = SimpleChatTokenizer()
    ids, mask, logprobs, versions, turns = tokenise(tok, messages)
    for t, r in zip(turns, turn_rewards, strict=True):
        t.reward = r
    return Trajectory(
        id=traj_id, task_id=str(task["id"]), env="mul", messages=messages, token_ids=ids, loss_mask=mask,
        logprobs=logprobs, versions=versions, turns=turns, reward=total, terminated=True,
        group_id="mul-group", seed=7, task=task,
    )  # fmt: skip
