"""Re-execution of stored trajectories against their env (agentrl.replay.reexec)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer, truncate_ids_text
from agentrl.env import Env, StepResult, Task
from agentrl.replay.reexec import default_env_factory, env_params, recheck
from agentrl.types import Message, Trajectory

HERE = Path(__file__).parent


@pytest.fixture
def mul_env_cls() -> Any:
    sys.path.insert(0, str(HERE))
    try:
        from mul_env_plugin import MulEnv
    finally:
        sys.path.remove(str(HERE))
    return MulEnv


async def recorded(a: int = 6, b: int = 7) -> Trajectory:
    sys.path.insert(0, str(HERE))
    try:
        from mul_env_plugin import record_mul_episode
    finally:
        sys.path.remove(str(HERE))
    traj: Trajectory = await record_mul_episode("t", a, b)
    return traj


async def test_reproduces_with_the_run_config_params(mul_env_cls: Any) -> None:
    traj = await recorded()

    def make(name: str) -> Env:
        return mul_env_cls(mul_env_cls.Config(**env_params({"env": {"name": "mul", "bonus": 0.5}}, name)))

    report = await recheck(traj, make)
    assert report.ok and report.reward_replayed == 1.5 and report.terminated_replayed
    # other params give another reward: the check notices
    other = await recheck(traj, lambda name: mul_env_cls(mul_env_cls.Config(bonus=0.0)))
    assert not other.ok and other.observations_ok and not other.reward_ok
    assert other.steps[-1].reward_stored == 1.5 and other.steps[-1].reward_replayed == 1.0


async def test_truncated_tool_output_and_missing_last_observation(mul_env_cls: Any) -> None:
    traj = await recorded(123456789123456789123456789, 987654321987654321987654321)
    full = traj.messages[2].content
    cut = truncate_ids_text(SimpleChatTokenizer(), full, 40, "middle")
    assert cut != full and cut.startswith(full[:4]) and cut.endswith(full[-4:])
    traj.messages[2] = dataclasses.replace(traj.messages[2], content=cut)
    make = lambda name: mul_env_cls(mul_env_cls.Config(bonus=0.5))  # noqa: E731
    assert (await recheck(traj, make)).ok
    traj.messages[2] = dataclasses.replace(traj.messages[2], content=cut.replace(full[:2], "99", 1))
    assert not (await recheck(traj, make)).ok
    # the opening may carry extra messages in front (a tools system prompt)
    traj2 = await recorded()
    traj2.messages.insert(0, Message("system", "tools: multiply"))
    assert (await recheck(traj2, make)).ok


class _Broken(Env):
    def tasks(self, split: str = "train") -> list[Task]:
        return []

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        return [Message("user", "What is 6 times 7? (seed 7)")], {}

    async def step(self, action: Message) -> StepResult:
        if action.tool_calls:
            raise RuntimeError("tool backend down")
        await asyncio.sleep(30)
        return StepResult([])


async def test_env_failures_are_reported_not_raised() -> None:
    traj = await recorded()
    report = await recheck(traj, lambda name: _Broken())
    assert not report.ok and report.error == "RuntimeError: tool backend down"
    traj.messages[1] = dataclasses.replace(traj.messages[1], tool_calls=[])
    slow = await recheck(traj, lambda name: _Broken(), timeout_s=0.2)
    assert not slow.ok and "did not answer within 0.2 s" in (slow.error or "")
    unknown = await recheck(traj, lambda name: (_ for _ in ()).throw(KeyError(name)))
    assert not unknown.ok and "KeyError" in (unknown.error or "")


def test_default_factory_uses_entry_points_and_plugin_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(HERE)
    make = default_env_factory({"env": {"name": "mul", "bonus": 2.0}, "plugins": ["mul_env_plugin"]})
    env = make("mul")
    assert type(env).__name__ == "MulEnv" and env.config.bonus == 2.0  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="calculatr"):
        make("calculatr")
