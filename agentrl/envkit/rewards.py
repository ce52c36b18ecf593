"""The reward contract: score a finished conversation against its task.

Rewards are plugins (entry-point group `agentrl.rewards`): verifiers (math,
code in a sandbox), reward models, or user functions. An env may use one or a
weighted mix; each returns a value plus an optional named breakdown that the
store keeps and the replay UI shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentrl.env import Task
from agentrl.types import JSON, Message


@dataclass(slots=True)
class RewardResult:
    """A score, the named parts it was made of, and free-form details."""

    value: float
    breakdown: dict[str, float] = field(default_factory=dict)
    info: dict[str, JSON] = field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Scores a finished episode. Must not block the event loop."""

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult: ...


@runtime_checkable
class ClosableReward(Protocol):
    """A reward holding resources (a verifier's worker pool, a model) it releases in `close()`."""

    async def close(self) -> None: ...


async def weighted(
    rewards: Sequence[tuple[str, float, Reward]], task: Task, messages: Sequence[Message]
) -> RewardResult:
    """Combine several rewards as a weighted sum; the breakdown names each part."""
    total = 0.0
    breakdown: dict[str, float] = {}
    info: dict[str, JSON] = {}
    for name, weight, reward in rewards:
        result = await reward.score(task, messages)
        total += weight * result.value
        breakdown[name] = result.value
        for k, v in result.breakdown.items():
            breakdown[f"{name}.{k}"] = v
        if result.info:
            info[name] = result.info
    return RewardResult(value=total, breakdown=breakdown, info=info)
