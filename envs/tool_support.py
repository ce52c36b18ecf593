"""A base for envs that are single-turn by default and multi-turn when given tools.

`dataset` and `math` share this shape (a `ToolEnv`): the opening messages come
from the task, the model may call tools when any are configured (tool plugins
named in `tools`, plus any the subclass adds), and the first reply without a
tool call ends the episode with the reward from the configured reward plugins.
With no tools at all the first reply ends the episode: single turn.

Reward objects and sandboxes are shared between the env instances of a run
through the run's `RunResources` (agentrl/run/resources.py): the rollout manager
builds one env per episode, the run closes the shared objects at its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator
from typing_extensions import TypeVar

from agentrl.env import EnvConfig, Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envkit.tool_env import ToolEnv, ToolEnvConfig
from agentrl.registry import check_named_plugin
from agentrl.run.resources import RunResources
from agentrl.tools import Tool
from agentrl.types import Message

from .reward_specs import NamedReward, RewardSpec, build_reward, score_all


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


def run_resources(resources: RunResources | None) -> tuple[RunResources, bool]:
    """The run's resources, or a private set the env owns (and closes) when built outside a run."""
    return (resources, False) if resources is not None else (RunResources(), True)


def resolve_plugins(plugins: Any) -> Any:
    if plugins is not None:
        return plugins
    from agentrl.registry import Plugins

    return Plugins.discover()


CapableConfigT = TypeVar("CapableConfigT", bound=ToolCapableConfig, default=ToolCapableConfig)
"""The config type of a `ToolCapableEnv[CapableConfigT]`."""


class ToolCapableEnv(ToolEnv[CapableConfigT]):
    """A ToolEnv whose tools come from plugin names and whose reward from reward specs."""

    Config: ClassVar[type[EnvConfig]] = ToolCapableConfig

    def __init__(
        self,
        config: CapableConfigT | None = None,
        *,
        rewards: Sequence[NamedReward] | None = None,
        extra_tools: Sequence[Tool] = (),
        plugins: Any = None,
        resources: RunResources | None = None,
    ) -> None:
        cfg = config if config is not None else self._default_config()
        self.plugins = plugins
        self.resources, self._owns_resources = run_resources(resources)
        named: list[Tool] = []
        if cfg.tools:
            self.plugins = resolve_plugins(plugins)
            named = [self.plugins.tools.get(name) for name in cfg.tools]
        super().__init__(cfg, tools=[*extra_tools, *named])
        self._rewards: list[NamedReward] | None = list(rewards) if rewards is not None else None

    async def rewards(self) -> list[NamedReward]:
        """The reward objects of this env (shared with the other envs of the run)."""
        if self._rewards is None:
            out: list[NamedReward] = []
            for i, spec in enumerate(self.config.rewards):
                def build(spec: RewardSpec = spec, where: str = f"rewards[{i}]") -> Any:
                    self.plugins = resolve_plugins(self.plugins)
                    return build_reward(spec, self.plugins, where=where)

                out.append((spec.name, spec.weight, self.resources.get("reward:" + spec.model_dump_json(), build)))
            self._rewards = out
        return self._rewards

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        return await score_all(await self.rewards(), task, messages)

    async def close(self) -> None:
        if self._owns_resources:
            await self.resources.aclose()
        await super().close()
