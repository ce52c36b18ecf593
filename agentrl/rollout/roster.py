"""Who plays which agent: agent id -> policy, and how each policy samples.

A run with `policies:` hands the rollout a `Roster` built from `agents:`
(agentrl.run.policies); a run without one uses `Roster()`, where every agent
is played by the engine's own weights (one policy, self-play included). The
rollout asks it, per turn, which policy acts and whether that policy is a
model (an adapter, or the engine's own weights) or a move the env makes
itself (`opponent`: "random" or "scripted", `agentrl.env.OpponentMoves`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SINGLE_AGENT = "agent"
"""The agent id of a single-agent env's one agent (`agents: {agent: alice}`)."""

ANY_AGENT = "*"
"""The roster key for every agent it does not name."""

TASK_AGENT = "@task"
"""The roster key for the agent a task names in `task["agent"]` (e.g. the seat the trained policy takes
against a fixed opponent, alternating over the tasks): `{"@task": me, "*": bot}`."""


@dataclass(frozen=True, slots=True)
class Seat:
    """How one agent's turns are played: by `policy` (None: the run's one policy), sampled with
    `adapter` (None: the engine's own weights), or moved by the env (`opponent`)."""

    policy: str | None = None
    adapter: str | None = None
    opponent: str | None = None


@dataclass(frozen=True, slots=True)
class Roster:
    """agent id -> policy name, and policy name -> how it samples (`Seat`)."""

    agents: Mapping[str, str] = field(default_factory=dict)
    adapters: Mapping[str, str | None] = field(default_factory=dict)  # policy -> adapter (None: base weights)
    opponents: Mapping[str, str] = field(default_factory=dict)  # policy -> "random" | "scripted"

    def seat(self, agent: str, task: Mapping[str, object] | None = None) -> Seat:
        """How `agent` plays (in `task`); an agent the roster does not know is an error naming the ones it does.

        The agent's own key wins, then `@task` when `task["agent"]` names it, then `*`.
        """
        if not self.agents:
            return Seat()
        policy = self.agents.get(agent)
        if policy is None and task is not None and task.get("agent") == agent:
            policy = self.agents.get(TASK_AGENT)
        if policy is None:
            policy = self.agents.get(ANY_AGENT)
        if policy is None:
            raise KeyError(
                f"agent {agent!r} has no policy: agents maps {sorted(self.agents)}; add it (or '{ANY_AGENT}')"
            )
        if policy in self.opponents:
            return Seat(policy=policy, opponent=self.opponents[policy])
        return Seat(policy=policy, adapter=self.adapters.get(policy, policy))
