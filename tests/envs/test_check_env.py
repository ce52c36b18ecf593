"""Every built-in env of this area passes agentrl.envkit.check.check_env."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentrl.env import Env, Task
from agentrl.envkit.check import acheck_env
from agentrl.envkit.rewards import RewardResult
from agentrl.envs.code_env import CodeEnv
from agentrl.envs.dataset_env import DatasetEnv
from agentrl.envs.gym_text import GymTextEnv
from agentrl.envs.math_env import MathEnv
from agentrl.envs.reasoning_gym_env import ReasoningGymEnv
from agentrl.run.resources import RunResources
from agentrl.types import Message


class LastNumber:
    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        numbers = re.findall(r"-?\d+", messages[-1].content)
        return RewardResult(value=float(bool(numbers) and numbers[-1] == str(task["answer"])))


def replying(text: str) -> Any:
    return lambda messages: text


@pytest.mark.parametrize(
    "env",
    [
        ReasoningGymEnv(ReasoningGymEnv.Config(train_size=8, test_size=4)),
        GymTextEnv(GymTextEnv.Config(game="frozenlake", train_size=8, max_steps=4)),
        GymTextEnv(GymTextEnv.Config(game="taxi", train_size=8, max_steps=4)),
        GymTextEnv(GymTextEnv.Config(game="blackjack", train_size=8)),
        MathEnv(MathEnv.Config(train_size=8, test_size=4), rewards=[("last_number", 1.0, LastNumber())]),
    ],
    ids=["reasoning_gym", "frozenlake", "taxi", "blackjack", "math"],
)
async def test_env_passes_check_env(env: Env) -> None:
    report = await acheck_env(env)
    assert report.episodes >= 2 and report.steps >= 2
    report = await acheck_env(env, policy=replying("<action>left</action> <answer>3</answer> \\boxed{3}"))
    assert report.steps >= 2


async def test_dataset_env_passes_check_env(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) for i in range(12)))
    env = DatasetEnv(DatasetEnv.Config(source={"path": str(path)}, test_fraction=0.3),
                     rewards=[("last_number", 1.0, LastNumber())])
    report = await acheck_env(env)
    assert report.episodes >= 2


async def test_code_env_passes_check_env(local_sandbox: Any) -> None:
    env = CodeEnv(CodeEnv.Config(max_attempts=2), sandbox=local_sandbox)
    report = await acheck_env(env)
    assert report.steps >= 2
    report = await acheck_env(env, policy=replying("```python\nprint(input())\n```"))
    assert report.steps >= 2


async def test_installed_entry_points_build_envs_that_pass_with_their_default_rewards(tmp_path: Path) -> None:
    """By name through the registry, as `agentrl train`/`check-env` do: real verifier, real sandbox."""
    from agentrl.registry import Plugins

    plugins = Plugins.discover()
    assert {"math", "code", "reasoning_gym", "gym_text", "dataset"} <= set(plugins.envs.names())
    assert "reward_model" in plugins.rewards.names()
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}))
    params: dict[str, dict[str, Any]] = {
        "math": {"train_size": 4, "test_size": 2},
        "code": {"max_attempts": 2},
        "reasoning_gym": {"train_size": 4, "test_size": 2},
        "gym_text": {"game": "taxi", "max_steps": 3},
        "dataset": {"source": {"path": str(data)}, "test_fraction": 0.0},
    }
    resources = RunResources()  # as in a run: the verifiers and sandboxes are shared and closed at the end
    try:
        for name, p in params.items():
            env = plugins.create_env(name, p, resources=resources)
            report = await acheck_env(env, policy=replying("\\boxed{4} <answer>4</answer> <action>north</action>"))
            assert report.episodes >= 1, name
        env = plugins.create_env("dataset", params["dataset"], resources=resources)
        await env.reset(next(iter(env.tasks())))
        result = await env.step(Message(role="assistant", content="2 + 2 = \\boxed{4}"))
        assert result.reward == 1.0 and result.reward_breakdown["math"] == 1.0  # the real math verifier
        await env.close()
    finally:
        await resources.aclose()
