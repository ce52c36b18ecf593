"""One multi-agent episode: agents take turns, each in its own token-exact Conversation.

An env with the `TurnTaking` capability names the agent who acts next; the
roster (`agentrl.rollout.roster`) says which policy plays it. Each agent that a
model plays has a Conversation of its own: reset's opening, then what it
observes (`env.observe(agent)`: the others' moves as the env reports them) and
the env's answers to its own moves. A policy that is an env-made move
(`opponent: random|scripted`) has none. The episode yields one Trajectory per
model-played agent, all in the same group, each with that agent's reward (the
sum of its rewards: `StepResult.agent_rewards`, else the acting agent's
`reward`), its policy on every turn (`Turn.policy`) and `info["agent"]`,
`info["policy"]`, `info["outcome"]` ("win", "loss", "draw" when the env's last
step reports `info["winner"]`).

Deadlines, budgets and failure classes are those of `run_episode`
(agentrl.rollout.episode); the budgets apply to each agent's conversation.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from agentrl.chat.conversation import Budgets, ChatTokenizer, Conversation
from agentrl.engines.base import InferenceEngine
from agentrl.env import Env, OpponentMoves, StepResult, Task, TurnTaking
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import (
    EpisodeFailure,
    EpisodeState,
    decode_action,
    episode_seed,
    play,
    sampling_template,
)
from agentrl.rollout.roster import Roster
from agentrl.types import JSON, EpisodeError, ErrorClass, Message, Trajectory, Turn

YOUR_TURN = Message(role="user", content="Your turn.")
"""What an agent is told when it acts again with nothing new to read (the template needs a message between turns)."""


async def run_turns(
    env: Env,
    task: Task,
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    config: RolloutConfig,
    roster: Roster,
    *,
    seed: int | None = None,
    group_id: str = "",
    sample_index: int = 0,
) -> list[Trajectory]:
    """Play one episode of a `TurnTaking` env; never raises for episode failures (only on cancel)."""
    if not isinstance(env, TurnTaking):
        raise TypeError(f"run_turns needs a TurnTaking env (agents/current_agent/observe); {type(env).__name__} is not")
    episode = _Turns(env, task, engine, tokenizer, config, seed, roster)
    error = await play(episode)
    return episode.trajectories(error, group_id=group_id, sample_index=sample_index)


class _Turns(EpisodeState):
    """The state of one multi-agent episode (the deadlines and failure handling are `EpisodeState`'s)."""

    def __init__(
        self, env: Env, task: Task, engine: InferenceEngine, tokenizer: ChatTokenizer, config: RolloutConfig,
        seed: int | None, roster: Roster,
    ) -> None:
        super().__init__(env, task, engine, tokenizer, config, seed)
        self.roster = roster
        self.convs: dict[str, Conversation] = {}  # model-played agents, in order of first turn
        self.pending: dict[str, list[Message]] = {}  # messages an agent reads before its next turn
        self.rewards: dict[str, float] = {}
        self.last_turn: dict[str, Turn] = {}
        self.winner: str | None = None

    def turns(self) -> int:
        return sum(len(c.turns) for c in self.convs.values())

    async def run(self) -> None:
        env, config = self.env, self.config
        assert isinstance(env, TurnTaking)
        t = time.monotonic()
        self.opening, _ = await self.bounded(
            env.reset(self.task, seed=self.seed), config.env_timeout_s, ErrorClass.ENV, "env.reset"
        )
        self.env_s += time.monotonic() - t
        self.rewards = dict.fromkeys(env.agents(), 0.0)
        template = sampling_template(config, self.tokenizer)
        for turn in itertools.count():
            agent = env.current_agent()
            if agent is None:
                self.terminated = True
                return
            seat = self.roster.seat(agent, self.task)
            if seat.opponent is not None:
                if not isinstance(env, OpponentMoves):
                    raise EpisodeFailure(ErrorClass.ENV, f"policy {seat.policy!r} is opponent: {seat.opponent}, but "
                                         f"env {env.episode_name()!r} makes no moves itself (no opponent_move)")
                env.observe(agent)  # read, so the opponent's view does not pile up
                action = env.opponent_move(agent, seat.opponent, episode_seed(self.seed, turn) or 0)
            else:
                conv = self._conversation(agent, env.observe(agent))
                if conv is None:
                    return
                max_new = conv.max_new_tokens()
                if max_new <= 0:
                    self.truncated, self.reason = True, conv.exhausted() or "max_total_tokens"
                    return
                sampling = template.for_turn(max_new, episode_seed(self.seed, turn)).with_adapter(seat.adapter)
                t = time.monotonic()
                completion = await self.bounded(
                    self.engine.generate(conv.token_ids, sampling), config.generate_timeout_s, ErrorClass.ENGINE,
                    "engine.generate",
                )
                self.gen_s += time.monotonic() - t
                action = decode_action(env, self.tokenizer, completion)
                conv.add_completion(completion, action)
                last = self.last_turn[agent] = conv.turns[-1]
                last.policy = seat.policy
            t = time.monotonic()
            result = await self.bounded(env.step(action), config.env_timeout_s, ErrorClass.ENV, "env.step")
            self.env_s += time.monotonic() - t
            self._score(agent, result)
            if agent in self.convs:
                self.pending.setdefault(agent, []).extend(result.messages)
            if result.terminated or result.truncated:
                self.terminated, self.truncated = result.terminated, result.truncated
                self.reason = None if result.terminated else (result.truncation_reason or "env")
                return

    def _conversation(self, agent: str, observed: list[Message]) -> Conversation | None:
        """`agent`'s conversation with what it has to read appended; None when that outgrew the token budget."""
        pending = self.pending.setdefault(agent, [])
        pending.extend(observed)
        conv = self.convs.get(agent)
        if conv is None:
            conv = self.convs[agent] = Conversation(
                self.tokenizer, [*self.opening, *pending], tools=self.env.prompt_tools(),
                budgets=Budgets.from_rollout_config(self.config),
            )
        elif not conv.add_messages(pending or [YOUR_TURN]):
            self.truncated, self.reason = True, "max_total_tokens"
            return None
        pending.clear()
        return conv

    def _score(self, agent: str, result: StepResult) -> None:
        """Add the step's rewards to each agent's total and to its latest turn."""
        rewards = result.agent_rewards if result.agent_rewards is not None else {agent: result.reward}
        for who, reward in rewards.items():
            if not math.isfinite(reward):
                raise EpisodeFailure(ErrorClass.REWARD, f"env.step returned a non-finite reward {reward!r} for {who!r}")
            self.rewards[who] = self.rewards.get(who, 0.0) + reward
            if who in self.last_turn:
                self.last_turn[who].reward += reward
        self.breakdown.update({str(k): float(v) for k, v in result.reward_breakdown.items()})
        winner = result.info.get("winner")
        if isinstance(winner, str):
            self.winner = winner

    def trajectories(self, error: EpisodeError | None, *, group_id: str, sample_index: int) -> list[Trajectory]:
        """One trajectory per model-played agent (a failed start: one empty trajectory carrying the error)."""
        if not self.convs:
            return [self.trajectory(error, group_id=group_id, sample_index=sample_index)]
        out = []
        wall_s = time.monotonic() - self.started
        for agent, conv in self.convs.items():
            seat = self.roster.seat(agent, self.task)
            info: dict[str, JSON] = {"agent": agent, "policy": seat.policy}
            if self.winner is not None:
                info["outcome"] = "draw" if self.winner not in self.rewards else ("win" if self.winner == agent else "loss")
            fields: dict[str, Any] = {
                "reward": 0.0 if error else self.rewards.get(agent, 0.0), "reward_breakdown": dict(self.breakdown),
                "terminated": self.terminated, "truncated": self.truncated, "truncation_reason": self.reason,
                "error": error, "group_id": group_id, "sample_index": sample_index, "seed": self.seed,
                "task": dict(self.task), "info": info,
            }
            metrics = {"turns": float(len(conv.turns)), "sampled_tokens": float(conv.num_sampled), "wall_s": wall_s,
                       "generate_s": self.gen_s, "env_s": self.env_s}
            out.append(conv.to_trajectory(task_id=str(self.task.get("id", "")), env=self.env.episode_name(),
                                          metrics=metrics, **fields))
        return out
