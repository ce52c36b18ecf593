"""Reward specs in env configs resolve through the plugin registry, with validated params."""

from __future__ import annotations

import types
from collections.abc import Sequence

import pytest
from pydantic import BaseModel, ConfigDict

import agentrl
from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envs.reward_specs import RewardSpec, build_rewards, score_all
from agentrl.errors import ConfigError, PluginError
from agentrl.types import Message


class ContainsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    word: str


@agentrl.reward("contains")
class Contains:
    Config = ContainsConfig

    def __init__(self, config: ContainsConfig) -> None:
        self.word = config.word

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        return RewardResult(value=float(self.word in messages[-1].content))


@agentrl.reward("short")
async def short(task: Task, messages: Sequence[Message]) -> float:
    return 1.0 if len(messages[-1].content) < 10 else 0.0


@pytest.fixture
def plugins() -> agentrl.Plugins:
    module = types.ModuleType("my_rewards")
    module.Contains = Contains  # type: ignore[attr-defined]
    module.short = short  # type: ignore[attr-defined]
    return agentrl.Plugins.discover([module], entry_points=False)


async def test_class_and_function_rewards_mixed(plugins: agentrl.Plugins) -> None:
    specs = [RewardSpec(name="contains", params={"word": "cat"}), RewardSpec(name="short", weight=0.5)]
    rewards = build_rewards(specs, plugins=plugins)
    result = await score_all(rewards, {"id": "t"}, [Message(role="assistant", content="a cat")])
    assert result.value == 1.5 and result.breakdown == {"contains": 1.0, "short": 1.0}
    alone = await score_all(rewards[:1], {"id": "t"}, [Message(role="assistant", content="a dog")])
    assert alone.value == 0.0 and alone.breakdown == {"contains": 0.0}


def test_errors_name_the_key_and_the_choices(plugins: agentrl.Plugins) -> None:
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.params\.word"):
        build_rewards([RewardSpec(name="contains")], plugins=plugins)
    with pytest.raises(PluginError, match="contain"):
        build_rewards([RewardSpec(name="contain")], plugins=plugins)
    with pytest.raises(ConfigError, match="takes no parameters"):
        build_rewards([RewardSpec(name="short", params={"x": 1})], plugins=plugins)


def test_reward_and_tool_names_and_params_are_checked_when_the_env_is_configured() -> None:
    """Through the run's registry (user plugins included), not at the first scored episode."""
    module = types.ModuleType("my_rewards")
    module.Contains = Contains  # type: ignore[attr-defined]
    module.short = short  # type: ignore[attr-defined]
    plugins = agentrl.Plugins.discover([module])  # the built-in envs and tools too
    dataset = {"source": {"path": "unused.jsonl"}}
    with pytest.raises(ConfigError, match=r"env\.rewards\.0: .*params\.word: required key is missing"):
        plugins.env_config("dataset", {**dataset, "rewards": [{"name": "contains"}]})
    with pytest.raises(ConfigError, match=r"env\.rewards\.0: .*name: unknown reward 'contain'; did you mean"):
        plugins.env_config("dataset", {**dataset, "rewards": [{"name": "contain"}]})
    with pytest.raises(ConfigError, match=r"env\.tools: .*name: unknown tool 'calculater'; did you mean 'calculator'"):
        plugins.env_config("dataset", {**dataset, "rewards": [{"name": "short"}], "tools": ["calculater"]})
    code = {"name": "code", "params": {"sandbox": {"name": "local", "pool_sise": 3}}}  # the reward's own sandbox
    with pytest.raises(ConfigError, match=r"env\.rewards\.0: .*params\.pool_sise: unknown key; did you mean 'pool_size'"):
        plugins.env_config("dataset", {**dataset, "rewards": [code]})
    config = plugins.env_config("dataset", {**dataset, "rewards": [{"name": "contains", "params": {"word": "x"}}]})
    assert config.rewards[0].params == {"word": "x"}  # type: ignore[attr-defined]
