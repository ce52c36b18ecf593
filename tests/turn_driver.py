"""A local multi-agent episode driver for `TurnTaking` envs, as the run's episode runner drives them.

reset -> loop { a = current_agent(); None: end; a's conversation += observe(a);
a's mover produces one assistant message (through `env.parse_action` for text);
result = step(action); a's conversation += result.messages; rewards accumulate
per agent (`agent_rewards`, else `reward` for a); stop at terminated/truncated }.

Used by the env tests (tests/envs, tests/agentrl/envkit); no model needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.env import Env, OpponentMoves, StepResult, Task, TurnTaking
from agentrl.types import Message

Mover = Callable[[Any, str, int], Message]
"""(env, agent, turn index) -> the agent's assistant message."""


@dataclass
class Played:
    """What one driven episode left: each agent's conversation and return, every step result."""

    conversations: dict[str, list[Message]]
    returns: dict[str, float]
    results: list[tuple[str, StepResult]] = field(default_factory=list)

    @property
    def last(self) -> StepResult:
        return self.results[-1][1]

    @property
    def winner(self) -> Any:
        return self.last.info.get("winner")


def opponent(kind: str, seed: int = 0) -> Mover:
    """A mover playing the env's own `OpponentMoves` of `kind`, seeded per turn."""

    def move(env: Any, agent: str, turn: int) -> Message:
        assert isinstance(env, OpponentMoves)
        return env.opponent_move(agent, kind, seed * 1000 + turn)

    return move


def replies(texts: list[str]) -> Mover:
    """A mover that answers with these texts in order (through `parse_action`), as a model would."""
    queue = list(texts)

    def move(env: Any, agent: str, turn: int) -> Message:
        assert queue, f"{agent} ran out of scripted replies at turn {turn}"
        return env.parse_action(queue.pop(0))  # type: ignore[no-any-return]

    return move


async def play(
    env: Env[Any], task: Task, movers: dict[str, Mover], *, seed: int | None = 0, max_steps: int = 500
) -> Played:
    """Drive one episode of `env` on `task`, each agent moved by its mover."""
    assert isinstance(env, TurnTaking)
    opening, _ = await env.reset(task, seed=seed)
    agents = env.agents()
    played = Played(conversations={a: list(opening) for a in agents}, returns=dict.fromkeys(agents, 0.0))
    for turn in range(max_steps):
        agent = env.current_agent()
        if agent is None:
            return played
        played.conversations[agent].extend(env.observe(agent))
        action = movers[agent](env, agent, turn)
        played.conversations[agent].append(action)
        result = await env.step(action)
        played.results.append((agent, result))
        played.conversations[agent].extend(result.messages)
        rewards = result.agent_rewards if result.agent_rewards is not None else {agent: result.reward}
        for name, value in rewards.items():
            played.returns[name] += value
        if result.terminated or result.truncated:
            return played
    raise AssertionError(f"episode did not end in {max_steps} steps")
