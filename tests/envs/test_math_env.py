"""math env: problems from reasoning-gym or a file, \\boxed answers, the sandboxed python tool."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envs.math_env import MathEnv
from agentrl.types import Message


class Boxed:
    """Stand-in verifier: \\boxed{x} equals task['answer'] as text."""

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        found = re.findall(r"\\boxed\{([^}]*)\}", messages[-1].content)
        return RewardResult(value=float(bool(found) and found[-1].strip() == task["answer"]))


def make(**params: Any) -> MathEnv:
    return MathEnv(MathEnv.Config(**params), rewards=[("boxed", 1.0, Boxed())])


async def test_generated_problems_single_turn() -> None:
    env = make(train_size=20, test_size=10, seed=1)
    train = list(env.tasks("train"))
    assert [t["id"] for t in train] == [t["id"] for t in make(train_size=20, test_size=10, seed=1).tasks()]
    assert not {t["question"] for t in train} & {t["question"] for t in env.tasks("test")}
    messages, _ = await env.reset(train[0])
    assert "\\boxed" in messages[0].content and messages[1].content == train[0]["question"]
    right = await env.step(Message(role="assistant", content=f"It is \\boxed{{{train[0]['answer']}}}."))
    assert right.terminated and right.reward == 1.0 and right.reward_breakdown == {"boxed": 1.0}


async def test_problems_from_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {i} * 3?", "answer": 3 * i}) for i in range(30)))
    env = make(problems_path=str(path), test_fraction=0.2)
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert len(train) + len(test) == 30 and test and train
    await env.reset(train[0])
    wrong = await env.step(Message(role="assistant", content="\\boxed{-1}"))
    assert wrong.terminated and wrong.reward == 0.0


async def test_python_tool_runs_in_the_sandbox(local_sandbox: Any) -> None:
    env = MathEnv(MathEnv.Config(mode="tool"), sandbox=local_sandbox, rewards=[("boxed", 1.0, Boxed())])
    assert await env.run_python("print(17 * 23)") == "391"
    failed = await env.run_python("1 / 0")
    assert "ZeroDivisionError" in failed and "[error" in failed
    assert "no output" in await env.run_python("x = 1")
    messages, _ = await env.reset(next(iter(env.tasks())))
    assert "python" in messages[0].content


def test_config_errors() -> None:
    with pytest.raises(ValidationError, match="single mode takes no tools"):
        MathEnv.Config(tools=["calculator"])
    with pytest.raises(ValidationError, match="mode"):
        MathEnv.Config(mode="multi")
