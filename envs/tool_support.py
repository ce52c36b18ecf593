"""A base for envs that are single-turn by default and multi-turn when given tools.

`dataset` and `math` share this shape (a `ToolEnv`): the opening messages come
from the task, the model may call tools when any are configured (tool plugins
named in `tools`, plus any the subclass adds), and the first reply without a
tool call ends the episode with the reward from the configured reward plugins.
With no tools at all the first reply ends the episode: single turn.

Reward objects and sandboxes are shared between the env instances of a run
(`agentrl.envs.shared`): the rollout manager builds one env per episode.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from agentrl.env import Task
from agentrl.registry import check_named_plugin
from agentrl.rewards import RewardResult
from agentrl.tool_env import ToolEnv, ToolEnvConfig
from agentrl.tools import Tool
from agentrl.types import Message

from .reward_specs import NamedReward, RewardSpec, build_reward, score_all
from .shared import shared_objects


class ToolCapableConfig(ToolEnvConfig):
    """Tool and reward settings shared by envs that can run single-turn or with tools."""

    tools: list[str] = Field(default_factory=list, description="tool plugin names; empty = single-turn")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="math", weight=1.0)], min_length=1,
        description="reward plugins, weighted and summed (default: the math verifier)",
    )

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, names: list[str], info: ValidationInfo) -> list[str]:
        for name in names:
            check_named_plugin(info.context, "tools", name)
        return names


def resolve_plugins(plugins: Any) -> Any:
    if plugins is not None:
        return plugins
    from agentrl.registry import Plugins

    return Plugins.discover()


class ToolCapableEnv(ToolEnv):
    """A ToolEnv whose tools come from plugin names and whose reward from reward specs."""

    config: ToolCapableConfig

    def __init__(
        self,
        config: ToolCapableConfig | None = None,
        *,
        rewards: Sequence[NamedReward] | None = None,
        extra_tools: Sequence[Tool] = (),
        plugins: Any = None,
    ) -> None:
        cfg = config if config is not None else self.Config.model_validate({})
        assert isinstance(cfg, ToolCapableConfig)
        self.plugins = plugins
        named: list[Tool] = []
        if cfg.tools:
            self.plugins = resolve_plugins(plugins)
            named = [self.plugins.tools.get(name) for name in cfg.tools]
        super().__init__(cfg, tools=[*extra_tools, *named])
        self._given_rewards = list(rewards) if rewards is not None else None
        self._acquired: list[str] = []
        self._rewards: list[NamedReward] | None = self._given_rewards

    async def rewards(self) -> list[NamedReward]:
        """The reward objects of this env (shared with the other envs of the run)."""
        if self._rewards is None:
            shared = shared_objects()
            out: list[NamedReward] = []
            for i, spec in enumerate(self.config.rewards):
                key = "reward:" + spec.model_dump_json()
                if key not in shared:
                    self.plugins = resolve_plugins(self.plugins)
                obj = shared.acquire(key, functools.partial(build_reward, spec, self.plugins, where=f"rewards[{i}]"))
                self._acquired.append(key)
                out.append((spec.name, spec.weight, obj))
            self._rewards = out
        return self._rewards

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        return await score_all(await self.rewards(), task, messages)

    async def close(self) -> None:
        if self._acquired:
            shared = shared_objects()
            for key in self._acquired:
                shared.release(key)
            self._acquired = []
            self._rewards = self._given_rewards
        await super().close()
