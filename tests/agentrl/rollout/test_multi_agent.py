"""Multi-agent episodes (agentrl.rollout.multi_agent): turns, views, rewards, policies, opponents."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from typing import Any

import pytest
from policy_engine import PolicyEngine, take

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.env import Env, OpponentMoves, StepResult, Task, TurnTaking
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager
from agentrl.rollout.multi_agent import run_turns
from agentrl.rollout.roster import Roster
from agentrl.types import ErrorClass, Message


class TakeAway(Env):
    """Two players take 1 or 2 stones from a pile in turn; who takes the last stone wins (+1, the other -1).

    A reply that is not "1" or "2" (or takes more than is left) is refused with a
    message and a -0.1 penalty; the same player moves again.
    """

    name = "takeaway"

    def __init__(self) -> None:
        super().__init__()
        self.pile = 0
        self.turn = 0
        self.unseen: dict[str, list[Message]] = {}

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return [{"id": f"pile-{n}", "pile": n} for n in (4, 5, 7)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.pile, self.turn = int(task["pile"]), 0  # type: ignore[call-overload]
        self.unseen = {a: [Message("user", f"You are {a}. Pile: {self.pile}. Take 1 or 2.")] for a in self.agents()}
        return [Message("system", "Take-away: who takes the last stone wins.")], {}

    def agents(self) -> list[str]:
        return ["player_0", "player_1"]

    def current_agent(self) -> str | None:
        return None if self.pile == 0 else self.agents()[self.turn % 2]

    def observe(self, agent: str) -> list[Message]:
        seen, self.unseen[agent] = self.unseen[agent], []
        return seen

    async def step(self, action: Message) -> StepResult:
        agent = self.agents()[self.turn % 2]
        text = action.content.strip()
        if text not in ("1", "2") or int(text) > self.pile:
            return StepResult([Message("user", f"Illegal move {text!r}: take 1 or 2 (pile {self.pile}).")],
                              reward=-0.1)
        self.pile -= int(text)
        self.turn += 1
        other = self.agents()[self.turn % 2]
        if self.pile == 0:
            return StepResult([], terminated=True, agent_rewards={agent: 1.0, other: -1.0}, info={"winner": agent})
        self.unseen[other].append(Message("user", f"{agent} took {text}. Pile: {self.pile}."))
        return StepResult([])

    def opponent_move(self, agent: str, kind: str, seed: int) -> Message:
        if kind == "scripted":  # leave a multiple of 3 when possible
            take = self.pile % 3 or 1
        else:
            take = random.Random(seed).choice([1, 2] if self.pile >= 2 else [1])
        return Message("assistant", str(take))


CONFIG = RolloutConfig(group_size=2, groups_per_step=1, max_turns=8)


def test_the_game_is_a_turn_taking_env_with_opponent_moves() -> None:
    assert isinstance(TakeAway(), TurnTaking) and isinstance(TakeAway(), OpponentMoves)


async def test_self_play_gives_each_agent_its_own_view_reward_and_outcome() -> None:
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {None: take("1")})
    trajs = await run_turns(TakeAway(), {"id": "p", "pile": 4}, engine, tok, CONFIG, Roster(), seed=3, group_id="g")
    assert [t.info["agent"] for t in trajs] == ["player_0", "player_1"]
    first, second = trajs
    # 4 stones, one at a time: player_1 takes the last one
    assert (first.reward, second.reward) == (-1.0, 1.0)
    assert (first.info["outcome"], second.info["outcome"]) == ("loss", "win")
    assert all(t.error is None and t.terminated for t in trajs)
    assert [len(t.turns) for t in trajs] == [2, 2]
    # each sees the other's moves as the env reports them, never the other's own messages
    p0_text = " ".join(m.content for m in first.messages)
    assert "You are player_0" in p0_text and "You are player_1" not in p0_text
    assert "player_1 took 1. Pile: 2." in p0_text
    p1_text = " ".join(m.content for m in second.messages)
    assert "player_0 took 1. Pile: 3." in p1_text and "player_0 took 1. Pile: 1." in p1_text
    # the win is credited to the winner's last turn, the loss to the loser's
    assert second.turns[-1].reward == 1.0 and first.turns[-1].reward == -1.0
    assert all(t.group_id == "g" and t.seed == 3 for t in trajs)
    assert all(turn.policy is None for t in trajs for turn in t.turns)


async def test_two_policies_sample_with_their_own_adapters_and_versions() -> None:
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {"alice": take("2"), "bob": take("1")})
    engine.adapter_versions |= {"alice": 5, "bob": 2}
    roster = Roster(agents={"player_0": "alice", "player_1": "bob"})
    trajs = await run_turns(TakeAway(), {"id": "p", "pile": 5}, engine, tok, CONFIG, roster, seed=1)
    alice, bob = trajs
    assert engine.asked == ["alice", "bob", "alice"]  # 5 -2-> 3 -1-> 2 -2-> 0
    assert alice.info == {"agent": "player_0", "policy": "alice", "outcome": "win"}
    assert {turn.policy for turn in alice.turns} == {"alice"} and {turn.policy for turn in bob.turns} == {"bob"}
    assert set(alice.versions[i] for i, m in enumerate(alice.loss_mask) if m) == {5}
    assert set(bob.versions[i] for i, m in enumerate(bob.loss_mask) if m) == {2}
    assert alice.policies == ["alice"]


async def test_an_opponent_policy_moves_through_the_env_and_leaves_no_trajectory() -> None:
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {"alice": take("1")})
    engine.adapter_versions["alice"] = 0
    roster = Roster(agents={"player_0": "alice", "player_1": "bot"}, opponents={"bot": "scripted"})
    trajs = await run_turns(TakeAway(), {"id": "p", "pile": 7}, engine, tok, CONFIG, roster, seed=1)
    assert [t.info["agent"] for t in trajs] == ["player_0"]
    assert set(engine.asked) == {"alice"}
    # the scripted player leaves multiples of 3: 7 -1-> 6 -> ... it takes the last stone
    assert trajs[0].info["outcome"] == "loss" and trajs[0].reward == -1.0


async def test_an_illegal_move_is_told_to_the_mover_who_moves_again() -> None:
    tok = SimpleChatTokenizer()
    replies = iter(["three", "1", "1", "1", "1"])
    engine = PolicyEngine(tok, {None: lambda prompt: next(replies)})
    trajs = await run_turns(TakeAway(), {"id": "p", "pile": 4}, engine, tok, CONFIG, Roster(), seed=0)
    first = trajs[0]
    assert len(first.turns) == 3 and first.turns[0].reward == pytest.approx(-0.1)
    assert any("Illegal move 'three'" in m.content for m in first.messages)
    assert first.reward == pytest.approx(-1.1)


async def test_an_agent_without_a_policy_fails_the_episode_with_a_clear_error() -> None:
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {"alice": take("1")})
    roster = Roster(agents={"player_0": "alice"})
    engine.adapter_versions["alice"] = 0
    trajs = await run_turns(TakeAway(), {"id": "p", "pile": 4}, engine, tok, CONFIG, roster, seed=0)
    error = trajs[0].error
    assert error is not None and error.kind is ErrorClass.ENV and "player_1" in error.message
    assert all(t.reward == 0.0 for t in trajs)


async def test_an_opponent_in_an_env_that_cannot_move_itself_is_an_env_failure() -> None:
    class NoMoves(TakeAway):
        opponent_move = None  # type: ignore[assignment]

    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {None: take("1")})
    roster = Roster(agents={"*": "bot"}, opponents={"bot": "random"})
    trajs = await run_turns(NoMoves(), {"id": "p", "pile": 4}, engine, tok, CONFIG, roster, seed=0)
    error = trajs[0].error
    assert error is not None and "opponent_move" in error.message


async def test_the_manager_groups_every_agent_of_every_sample() -> None:
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {None: take("1")})
    manager = RolloutManager(TakeAway, TakeAway().tasks(), engine, tok, CONFIG, seed=0)
    async with manager:
        group = await asyncio.wait_for(anext(aiter(manager.groups())), 30)
    assert len(group.trajectories) == 2 * CONFIG.group_size
    assert sorted(t.info["agent"] for t in group.trajectories) == ["player_0", "player_0", "player_1", "player_1"]
    # zero-sum: each sample's two rewards cancel (no illegal moves here)
    by_sample: dict[int, float] = {}
    for t in group.trajectories:
        by_sample[t.sample_index] = by_sample.get(t.sample_index, 0.0) + t.reward
    assert all(v == 0.0 for v in by_sample.values())


def test_a_roster_seats_the_agent_a_task_names() -> None:
    roster = Roster(agents={"@task": "me", "*": "bot", "judge": "carol"}, opponents={"bot": "random"})
    assert roster.seat("player_1", {"agent": "player_1"}).policy == "me"
    assert roster.seat("player_0", {"agent": "player_1"}).policy == "bot"
    assert roster.seat("judge", {"agent": "judge"}).policy == "carol", "an agent's own key wins"
    assert roster.seat("player_1").policy == "bot"
    assert Roster(agents={"player_0": "me"}).seat("player_0").adapter == "me"
