"""check_env: a good env passes; each broken env gets a clear, specific problem list."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest
from pydantic import BaseModel

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.check import EnvCheckError, acheck_env, check_env
from agentrl.types import Message


class GuessEnv(Env):
    """Guess the number: the model says a number, the env says higher/lower."""

    name = "guess"

    class Config(EnvConfig):
        max_turns: int = 4

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": f"{split}-{i}", "target": i % 10} for i in range(20)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.target, self.turn = task["target"], 0
        return [Message(role="system", content="Guess 0-9."), Message(role="user", content="Your guess?")], {}

    async def step(self, action: Message) -> StepResult:
        self.turn += 1
        digits = [c for c in action.content if c.isdigit()]
        if digits and int(digits[0]) == self.target:
            return StepResult(messages=[], reward=1.0, terminated=True)
        return StepResult(
            messages=[Message(role="user", content="No.")],
            truncated=self.turn >= self.config.max_turns,  # type: ignore[attr-defined]
        )

    async def close(self) -> None:
        self.closed = True


def problems_of(env: Env, **kwargs: Any) -> list[str]:
    with pytest.raises(EnvCheckError) as e:
        check_env(env, **kwargs)
    assert str(e.value).startswith(f"env {e.value.env_name!r} fails {len(e.value.problems)} check(s):")
    return e.value.problems


def has(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


def test_good_env_passes() -> None:
    env = GuessEnv()
    report = check_env(env, n_episodes=3)
    assert report.env == "guess"
    assert report.episodes == 3 and report.steps == 12  # the trivial policy never guesses: truncated at 4
    assert report.tasks_checked == 20
    assert report.warnings == []
    assert env.closed


def test_custom_tasks_and_policy() -> None:
    report = check_env(GuessEnv(), tasks=[{"id": "x", "target": 7}], policy=lambda messages: "7", n_episodes=2)
    assert report.steps == 2 and report.episodes == 2


async def test_async_variant_and_sync_refuses_running_loop() -> None:
    report = await acheck_env(GuessEnv(), n_episodes=1)
    assert report.episodes == 1
    with pytest.raises(RuntimeError, match="acheck_env"):
        check_env(GuessEnv())


def test_bad_step_results_are_all_listed() -> None:
    class BadStep(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            return StepResult(
                messages=[Message(role="assistant", content="I am the env")],
                reward=math.nan,
                terminated=1,  # type: ignore[arg-type]
                truncated="no",  # type: ignore[arg-type]
                info=[],  # type: ignore[arg-type]
            )

    problems = problems_of(BadStep(), n_episodes=1)
    assert has(problems, "reward must be finite", "nan")
    assert has(problems, "terminated must be a bool", "int")
    assert has(problems, "truncated must be a bool", "str")
    assert has(problems, "info must be a dict", "list")
    assert has(problems, "role 'assistant'", "env messages are system/user/tool")


def test_bad_signals_are_problems_and_signals_left_in_info_a_warning() -> None:
    class BadSignals(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            return StepResult(messages=[], reward=1.0, terminated=True, reward_breakdown={"a": "x"},  # type: ignore[dict-item]
                              tool_errors=-1, truncation_reason=3)  # type: ignore[arg-type]

    problems = problems_of(BadSignals(), n_episodes=1)
    assert has(problems, "reward_breakdown must map names to floats")
    assert has(problems, "tool_errors must be a count")
    assert has(problems, "truncation_reason must be a str or None")

    class OldStyle(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            return StepResult(messages=[], reward=1.0, terminated=True, info={"reward_breakdown": {"a": 1.0}})

    report = check_env(OldStyle(), n_episodes=1)
    assert any("info holds ['reward_breakdown']" in w for w in report.warnings)


def test_reward_type_and_step_return_type() -> None:
    class StrReward(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            return StepResult(messages=[], reward="1", terminated=True)  # type: ignore[arg-type]

    assert has(problems_of(StrReward(), n_episodes=1), "reward must be a float", "str")

    class TupleStep(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            return ([], 1.0, True, False, {})  # type: ignore[return-value]

    assert has(problems_of(TupleStep(), n_episodes=1), "must return a StepResult, got tuple")


def test_bad_reset_shapes() -> None:
    class ListReset(GuessEnv):
        async def reset(self, task: Task, *, seed: int | None = None):  # type: ignore[no-untyped-def,override]
            return [Message(role="user", content="hi")]

    assert has(problems_of(ListReset(), n_episodes=1), "must return (messages, info), got list")

    class DictMessages(GuessEnv):
        async def reset(self, task: Task, *, seed: int | None = None):  # type: ignore[no-untyped-def,override]
            return [{"role": "user", "content": "hi"}], {}

    assert has(problems_of(DictMessages(), n_episodes=1), "message #0 is a dict, not an agentrl Message")

    class Empty(GuessEnv):
        async def reset(self, task: Task, *, seed: int | None = None):  # type: ignore[no-untyped-def,override]
            return [], {}

    assert has(problems_of(Empty(), n_episodes=1), "returned no messages")


def test_nondeterministic_reset() -> None:
    class Random(GuessEnv):
        async def reset(self, task: Task, *, seed: int | None = None):  # type: ignore[no-untyped-def,override]
            self.target, self.turn = task["target"], 0
            return [Message(role="user", content=f"salt {random.random()}")], {}

    assert has(problems_of(Random(), n_episodes=1), "is not deterministic", "same seed")


def test_bad_tasks() -> None:
    class BadTasks(GuessEnv):
        def tasks(self, split: str = "train") -> list[Task]:
            return [{"target": 1}, {"id": "a", "obj": object()}, {"id": "a"}, "task"]  # type: ignore[list-item]

    problems = problems_of(BadTasks(), n_episodes=1)
    assert has(problems, "task #0 has no 'id' key")
    assert has(problems, "task #1", "not JSON-serialisable")
    assert has(problems, "task ids are not unique", "'a'")
    assert has(problems, "task #3 is a str, not a dict")

    class Shuffled(GuessEnv):
        def tasks(self, split: str = "train") -> list[Task]:
            tasks = super().tasks(split)
            random.shuffle(tasks)
            return tasks

    assert has(problems_of(Shuffled(), n_episodes=1), "tasks('train') is not deterministic")

    class NoTasks(GuessEnv):
        def tasks(self, split: str = "train") -> list[Task]:
            return []

    assert has(problems_of(NoTasks()), "yielded no tasks")


def test_close_must_be_idempotent() -> None:
    class CloseOnce(GuessEnv):
        async def close(self) -> None:
            if getattr(self, "closed", False):
                raise RuntimeError("already closed")
            self.closed = True

    assert has(problems_of(CloseOnce(), n_episodes=1), "a second close() raised RuntimeError: already closed")


def test_hanging_step_is_reported_not_waited_on() -> None:
    class Hangs(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            await asyncio.sleep(3600)
            raise AssertionError

    assert has(problems_of(Hangs(), n_episodes=1, timeout_s=0.2), "step 0 did not return within 0.2s")


def test_step_exception_is_reported() -> None:
    class Raises(GuessEnv):
        async def step(self, action: Message) -> StepResult:
            raise KeyError("target")

    assert has(problems_of(Raises(), n_episodes=1), "episode 0 step 0 raised KeyError")


def test_class_level_contract() -> None:
    class Loose(BaseModel):
        x: int = 1

    class SyncAndLoose(GuessEnv):
        Config = Loose  # type: ignore[assignment]

        def reset(self, task, *, seed=None):  # type: ignore[no-untyped-def,override]
            return [], {}

    problems = problems_of(SyncAndLoose(Loose()))  # type: ignore[arg-type]
    assert has(problems, "SyncAndLoose.reset must be an async method")
    assert has(problems, "Config must forbid unknown keys")
    with pytest.raises(EnvCheckError, match="is not an agentrl Env instance"):
        check_env(object())  # type: ignore[arg-type]


class FakeTool:
    def __init__(self, name: Any, schema: Any) -> None:
        self.name = name
        self._schema = schema

    def schema(self) -> Any:
        return self._schema

    async def call(self, arguments: dict[str, Any]) -> str:
        return ""


def fn_schema(name: str, parameters: Any, description: str = "does things") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def test_tool_schemas() -> None:
    good = FakeTool("add", fn_schema("add", {"type": "object", "properties": {"a": {"type": "integer"}}}))
    env = GuessEnv()
    env.tools = [good]
    assert check_env(env, n_episodes=1).warnings == []

    env = GuessEnv()
    env.tools = [
        good,
        FakeTool("add", fn_schema("add", {"type": "object", "properties": {}})),
        FakeTool("bad name!", fn_schema("bad name!", {"type": "object", "properties": {}})),
        FakeTool("mismatch", fn_schema("other", {"type": "object", "properties": {}})),
        FakeTool("req", fn_schema("req", {"type": "object", "properties": {}, "required": ["x"]})),
        FakeTool("arr", fn_schema("arr", {"type": "array"})),
        FakeTool("flat", {"name": "flat"}),
    ]
    problems = problems_of(env, n_episodes=1)
    assert has(problems, "tool name 'add' is used by more than one tool")
    assert has(problems, "tools[2].name 'bad name!' must match")
    assert has(problems, "tools[3]", "function name 'other' differs from tool.name 'mismatch'")
    assert has(problems, "tools[4] (req) parameters.required names unknown properties: ['x']")
    assert has(problems, "tools[5] (arr) parameters must be a JSON schema of type 'object'")
    assert has(problems, "tools[6].schema() must be {'type': 'function'")

    env = GuessEnv()
    env.tools = [FakeTool("quiet", fn_schema("quiet", {"type": "object", "properties": {}}, description=""))]
    assert any("has no description" in w for w in check_env(env, n_episodes=1).warnings)


def test_real_tool_schema_passes() -> None:
    tools = pytest.importorskip("agentrl.tools")

    @tools.tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    env = GuessEnv()
    env.tools = [multiply]
    assert check_env(env, n_episodes=1).warnings == []
