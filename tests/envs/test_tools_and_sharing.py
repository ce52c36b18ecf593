"""Tool mode (math's sandboxed python tool, dataset with plugin tools), real verifiers, shared objects."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import agentrl
from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envs.code_env import CodeEnv
from agentrl.envs.dataset_env import DatasetEnv
from agentrl.envs.math_env import MathEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode
from agentrl.run.resources import RunResources
from agentrl.types import Trajectory


@agentrl.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def plugins() -> agentrl.Plugins:
    """Registry with the real math verifier, the local sandbox and a user-module tool (no entry points)."""
    module = types.ModuleType("user_tools")
    module.add = add  # type: ignore[attr-defined]
    found = agentrl.Plugins.discover([module], entry_points=False)
    found.rewards.add("math", "agentrl.sandboxes.verifiers.math:MathVerifier", source="test")
    found.sandboxes.add("local", "agentrl.sandboxes.local:LocalSandbox", source="test")
    return found


async def play(env: agentrl.Env, task: agentrl.Task, replies: list[str]) -> Trajectory:
    tokenizer = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=replies), tokenizer=tokenizer)
    try:
        return await run_episode(env, task, engine, tokenizer, RolloutConfig(max_turns=6), seed=0)
    finally:
        await env.close()


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_math_tool_mode_runs_python_in_the_sandbox(tmp_path: Path, plugins: agentrl.Plugins) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "mul", "question": "What is 17 * 23 + 4?", "answer": "395"}))
    env = MathEnv(MathEnv.Config(mode="tool", problems_path=str(path), test_fraction=0.0), plugins=plugins)
    assert [t.name for t in env.tools] == ["python"]
    task = next(iter(env.tasks()))
    traj = await play(env, task, [call("python", code="print(17 * 23 + 4)"), "So the answer is \\boxed{395}."])
    assert traj.error is None and traj.terminated
    tool_msgs = [m for m in traj.messages if m.role == "tool"]
    assert [m.content for m in tool_msgs] == ["395"]
    assert traj.reward == 1.0 and traj.reward_breakdown["math"] == 1.0


async def test_math_single_turn_with_the_real_verifier(plugins: agentrl.Plugins) -> None:
    env = MathEnv(MathEnv.Config(train_size=3, test_size=0), plugins=plugins)
    task = next(iter(env.tasks()))
    right = await play(env, task, [f"\\boxed{{{task['answer']}}}"])
    wrong = await play(MathEnv(MathEnv.Config(train_size=3, test_size=0), plugins=plugins), task, ["\\boxed{x+1}"])
    assert right.reward == 1.0 and wrong.reward == 0.0


async def test_dataset_env_with_a_plugin_tool(tmp_path: Path, plugins: agentrl.Plugins) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "What is 1234 + 4321?", "a": "5555"}))
    config = DatasetEnv.Config(
        source={"path": str(path)}, columns={"question": "q", "answer": "a"}, test_fraction=0.0, tools=["add"]
    )
    env = DatasetEnv(config, plugins=plugins)
    traj = await play(env, next(iter(env.tasks())), [call("add", a=1234, b=4321), "\\boxed{5555}"])
    assert [m.content for m in traj.messages if m.role == "tool"] == ["5555"]
    assert traj.reward == 1.0 and len(traj.turns) == 2
    bad = await play(DatasetEnv(config, plugins=plugins), next(iter(env.tasks())), [call("add", a="x", b=1), "7"])
    assert bad.messages[2].role == "tool" and bad.messages[2].content.startswith("Error") and bad.reward == 0.0


async def test_envs_of_a_run_share_one_sandbox_closed_with_the_run(plugins: agentrl.Plugins) -> None:
    resources = RunResources()  # what `Parts` holds for a run
    first, second = CodeEnv(plugins=plugins, resources=resources), CodeEnv(plugins=plugins, resources=resources)
    sandbox = await first.sandbox()
    assert await second.sandbox() is sandbox and len(resources) == 1
    await first.close()
    await second.close()
    assert not sandbox.closed  # the run's, not the envs': the next episode's env uses it again
    await resources.aclose()
    assert sandbox.closed and len(resources) == 0


async def test_an_env_built_outside_a_run_closes_its_own_sandbox(plugins: agentrl.Plugins) -> None:
    env, other = CodeEnv(plugins=plugins), CodeEnv(plugins=plugins)
    sandbox = await env.sandbox()
    assert await other.sandbox() is not sandbox  # no hidden sharing between unrelated envs
    await env.close()
    await other.close()
    assert sandbox.closed


async def test_create_env_hands_the_run_resources_to_the_env(plugins: agentrl.Plugins) -> None:
    plugins.envs.add("code", "agentrl.envs.code_env:CodeEnv", source="test")
    resources = RunResources()
    env = plugins.create_env("code", {}, resources=resources)
    assert isinstance(env, CodeEnv) and env.resources is resources
    await env.close()
    await resources.aclose()


async def test_create_env_hands_the_run_plugins_to_the_env(tmp_path: Path, plugins: agentrl.Plugins) -> None:
    """A run builds envs through `Plugins.create_env`: tools and rewards named in the env's config
    resolve against the run's plugins (here a tool from a user module), not a fresh discovery."""
    plugins.envs.add("dataset", "agentrl.envs.dataset_env:DatasetEnv", source="test")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "What is 1234 + 4321?", "a": "5555"}))
    params = {"source": {"path": str(path)}, "columns": {"question": "q", "answer": "a"}, "test_fraction": 0.0,
              "tools": ["add"]}
    env = plugins.create_env("dataset", params)
    assert isinstance(env, DatasetEnv) and env.plugins is plugins
    traj = await play(env, next(iter(env.tasks())), [call("add", a=1234, b=4321), "\\boxed{5555}"])
    assert [m.content for m in traj.messages if m.role == "tool"] == ["5555"]
    assert traj.reward == 1.0


def test_create_env_leaves_envs_without_a_plugins_parameter_alone(plugins: agentrl.Plugins) -> None:
    plugins.envs.add("calculator", "agentrl.envs.calculator:CalculatorEnv", source="test")
    env = plugins.create_env("calculator", {})
    assert env.name == "calculator" and not hasattr(env, "plugins")
