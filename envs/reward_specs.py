"""Reward choices in env configs: `{name, weight, params}` resolved through the plugin registry.

Envs that let the user pick how they are scored (`dataset`, `math`) keep a
list of `RewardSpec`s in their config; `build_rewards` turns them into reward
objects (entry-point group `agentrl.rewards`, or `@agentrl.reward` in a user
module) and `score_all` combines them with `agentrl.envkit.rewards.weighted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import Task
from agentrl.envkit.rewards import Reward, RewardResult, weighted
from agentrl.registry import PluginRef
from agentrl.types import JSON, Message

NamedReward = tuple[str, float, Reward]


class RewardSpec(PluginRef):
    """One reward plugin by name, its weight in the mix and its own params (checked when the config loads)."""

    kind: ClassVar[str] = "rewards"
    name: str = Field(..., min_length=1, description="a registered agentrl.rewards plugin")
    weight: float = Field(1.0, description="multiplier of this reward in the weighted sum")
    params: dict[str, JSON] = Field(default_factory=dict, description="options of that reward plugin (its Config)")


class FunctionReward:
    """Adapts an `async def (task, messages) -> float | RewardResult` reward plugin to `Reward`."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        return as_result(await self.fn(task, messages))


def as_result(value: float | RewardResult) -> RewardResult:
    return value if isinstance(value, RewardResult) else RewardResult(value=float(value))


def build_reward(spec: RewardSpec, plugins: Any, *, where: str = "reward") -> Any:
    """One reward object from its spec: a class gets its validated `Config`
    (errors name `<where>.params.<key>`); a plain async function is wrapped as is."""
    obj = plugins.rewards.get(spec.name)
    config = plugins.validate_params("rewards", spec.name, spec.params, prefix=f"{where}.params")
    if isinstance(obj, type):
        return obj(config) if config is not None else obj()
    return FunctionReward(obj)


def build_rewards(specs: Sequence[RewardSpec], *, plugins: Any = None, prefix: str = "rewards") -> list[NamedReward]:
    """Resolve reward specs by name; `plugins` defaults to a fresh `Plugins.discover()`."""
    if plugins is None:
        from agentrl.registry import Plugins

        plugins = Plugins.discover()
    return [
        (spec.name, spec.weight, build_reward(spec, plugins, where=f"{prefix}[{i}]")) for i, spec in enumerate(specs)
    ]


async def score_all(rewards: Sequence[NamedReward], task: Task, messages: Sequence[Message]) -> RewardResult:
    """One reward as is; several as their weighted sum with a named breakdown."""
    if len(rewards) == 1 and rewards[0][1] == 1.0:
        name, _, reward = rewards[0]
        result = await reward.score(task, messages)
        return RewardResult(value=result.value, breakdown={name: result.value, **result.breakdown}, info=result.info)
    return await weighted(rewards, task, messages)
