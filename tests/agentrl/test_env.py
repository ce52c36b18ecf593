"""The env contract: `Env` is generic over its config, and the older plain-`Env` style still works."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.tool_env import ToolEnv, ToolEnvConfig
from agentrl.registry import Plugins
from agentrl.types import Message


class CountConfig(EnvConfig):
    n: int = Field(3, ge=1)


class _Episodes:
    """The abstract methods, so the test classes below only say what they test."""

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": "0"}]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        return [Message(role="user", content="hi")], {}

    async def step(self, action: Message) -> StepResult:
        return StepResult(messages=[], terminated=True)


class TypedEnv(_Episodes, Env[CountConfig]):
    """The type argument is the whole declaration: no `Config` line, and `self.config` is a CountConfig."""

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": str(i)} for i in range(self.config.n)]


class PlainEnv(_Episodes, Env):
    """A third-party plugin written before `Env` was generic: `Config` set by hand."""

    Config = CountConfig


def test_the_type_argument_is_the_env_config() -> None:
    assert TypedEnv.Config is CountConfig
    env = TypedEnv()
    assert isinstance(env.config, CountConfig) and env.config.n == 3
    assert len(list(TypedEnv(CountConfig(n=5)).tasks())) == 5


def test_a_plain_env_subclass_with_its_own_config_still_works() -> None:
    assert PlainEnv.Config is CountConfig
    assert isinstance(PlainEnv().config, CountConfig)
    plugins = Plugins()
    plugins.envs.add("plain", PlainEnv, source="test")
    plugins.envs.add("typed", TypedEnv, source="test")
    for name in ("plain", "typed"):  # the registry validates user params into either kind of Config
        env = plugins.create_env(name, {"n": 2})
        assert isinstance(env.config, CountConfig) and env.config.n == 2


def test_a_subclass_inherits_its_parents_config_and_may_narrow_it() -> None:
    class NarrowConfig(CountConfig):
        m: int = 0

    class Child(TypedEnv):
        pass

    class Narrow(Child):
        Config = NarrowConfig

    assert Child.Config is CountConfig
    assert isinstance(Narrow().config, NarrowConfig)


def test_a_config_that_contradicts_the_type_argument_is_refused_at_class_definition() -> None:
    class Other(EnvConfig):
        pass

    with pytest.raises(TypeError, match=r"Bad\.Config is Other, which is not a subclass of its type argument CountConfig"):
        class Bad(_Episodes, Env[CountConfig]):
            Config = Other


def test_tool_env_is_generic_too() -> None:
    class CalcConfig(ToolEnvConfig):
        digits: int = 2

    class Calc(ToolEnv[CalcConfig]):
        def tasks(self, split: str = "train") -> list[Task]:
            return [{"id": "0", "prompt": "1+1"}]

    env = Calc()
    assert Calc.Config is CalcConfig and env.config.digits == 2
    assert env.config.tool_parser == "hermes"  # the ToolEnvConfig keys are there
    assert ToolEnv.Config is ToolEnvConfig
