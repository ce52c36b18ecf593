"""The PettingZoo bridge over real PettingZoo classic games (tic-tac-toe, connect four, rock-paper-scissors)."""

from __future__ import annotations

import random
import sys
import types
from typing import Any

import pytest
from pydantic import ValidationError
from turn_driver import opponent, play, replies

from agentrl.env import OpponentMoves, TurnTaking
from agentrl.envkit.pettingzoo_bridge import PettingZooEnv, PettingZooEnvConfig, load_callable
from agentrl.registry import Plugins
from agentrl.types import Message

pytest.importorskip("pettingzoo.classic")

TTT = "pettingzoo.classic.tictactoe_v3"


def render_ttt(agent: str, observation: Any) -> str:
    """PettingZoo's tic-tac-toe planes (own marks, opponent's marks) as a board: X mine, O theirs, free cells by index."""
    planes = observation["observation"]
    cells = []
    for r in range(3):
        row = []
        for c in range(3):
            mark = "X" if planes[r][c][0] else "O" if planes[r][c][1] else str(r * 3 + c)
            row.append(mark)
        cells.append(" ".join(row))
    return "\n".join(cells)


def first_legal(agent: str, observation: Any, mask: Any, rng: random.Random) -> int:
    """A scripted opponent: the lowest legal action."""
    return int(next(i for i, ok in enumerate(mask) if ok))


def ttt(**kw: Any) -> PettingZooEnv:
    return PettingZooEnv(PettingZooEnvConfig.model_validate({"make": TTT, **kw}), render=render_ttt)


def official_returns(make: Any, seed: int, actions: list[int]) -> dict[str, float]:
    """Replay `actions` through PettingZoo's own AEC loop and sum what `last()` reports to each agent."""
    env = make()
    env.reset(seed=seed)
    returns: dict[str, float] = dict.fromkeys(env.possible_agents, 0.0)
    queue = list(actions)
    for agent in env.agent_iter():
        _, reward, terminated, truncated, _ = env.last()
        returns[agent] += float(reward)
        env.step(None if terminated or truncated else queue.pop(0))
    assert not queue
    return returns


def test_protocols_config_and_plugin() -> None:
    env = ttt()
    assert isinstance(env, TurnTaking) and isinstance(env, OpponentMoves)
    assert env.agents() == ["player_1", "player_2"]
    assert env.current_agent() is None
    assert Plugins.discover().envs.get("pettingzoo") is PettingZooEnv
    with pytest.raises(ValidationError):
        PettingZooEnvConfig.model_validate({"make": TTT, "bogus": 1})
    with pytest.raises(ValueError, match="module:function"):
        load_callable("no_colon_here")
    tasks = list(PettingZooEnv(PettingZooEnvConfig(make=TTT, num_tasks=4)).tasks("test"))
    assert [t["seed"] for t in tasks] == [1_000_000, 1_000_001, 1_000_002, 1_000_003]
    assert [t["agent"] for t in tasks] == ["player_1", "player_2", "player_1", "player_2"]


@pytest.mark.parametrize("seed", range(12))
async def test_tictactoe_rewards_match_pettingzoos_own_accounting(seed: int) -> None:
    from pettingzoo.classic import tictactoe_v3

    env = ttt()
    task = {"id": "t", "seed": seed}
    played = await play(env, task, {a: opponent("random", seed) for a in env.agents()})
    last = played.last
    assert last.terminated and not last.truncated and env.current_agent() is None
    actions = [int(r.info["action"]) for _, r in played.results]  # type: ignore[arg-type]
    assert played.returns == official_returns(tictactoe_v3.env, seed, actions)
    assert sum(played.returns.values()) == 0.0
    assert last.info["returns"] == played.returns
    best = max(played.returns.values())
    expected = "draw" if best == 0.0 else next(a for a, r in played.returns.items() if r == best)
    assert last.info["winner"] == expected
    assert all(r.agent_rewards is None for _, r in played.results[:-1])  # tic-tac-toe rewards only at the end


async def test_connect_four_random_games_are_legal_and_zero_sum() -> None:
    from pettingzoo.classic import connect_four_v3

    env = PettingZooEnv(PettingZooEnvConfig(make="pettingzoo.classic.connect_four_v3"))
    for seed in range(4):
        played = await play(env, {"id": "c", "seed": seed}, {a: opponent("random", seed) for a in env.agents()})
        assert all(r.info["illegal"] is False for _, r in played.results)
        actions = [int(r.info["action"]) for _, r in played.results]  # type: ignore[arg-type]
        assert played.returns == official_returns(connect_four_v3.env, seed, actions)
        assert sum(played.returns.values()) == 0.0 and played.last.terminated


async def test_rps_without_mask_truncates_and_sums_every_round() -> None:
    from pettingzoo.classic import rps_v2

    env = PettingZooEnv(
        PettingZooEnvConfig(
            make="pettingzoo.classic.rps_v2",
            make_kwargs={"num_actions": 3, "max_cycles": 4},
            action_names=["rock", "paper", "scissors"],
        )
    )
    moves = {"player_0": replies(["rock", "<action>paper</action>", "I go scissors", "2"]), "player_1": replies(["paper", "paper", "paper", "paper"])}
    played = await play(env, {"id": "r", "seed": 0}, moves)
    assert played.last.truncated and not played.last.terminated
    # rock<paper (p1 +1), paper=paper (0), scissors>paper (p0 +1) twice
    assert played.returns == {"player_0": 1.0, "player_1": -1.0}
    assert played.returns == official_returns(lambda: rps_v2.env(num_actions=3, max_cycles=4), 0, [0, 1, 1, 1, 2, 1, 2, 1])
    assert played.winner == "player_0" and played.last.info["reason"] == "truncated"
    rewarded = [r.agent_rewards for _, r in played.results if r.agent_rewards]
    assert rewarded == [{"player_0": -1.0, "player_1": 1.0}, {"player_0": 1.0, "player_1": -1.0}, {"player_0": 1.0, "player_1": -1.0}]
    assert "Legal actions: rock, paper, scissors." in played.conversations["player_0"][0].content


async def test_observe_once_with_render_and_announcements() -> None:
    env = ttt(instructions="Play tic-tac-toe.")
    opening, info = await env.reset({"id": "t", "seed": 0})
    assert opening == [Message(role="system", content="Play tic-tac-toe.")] and info["first"] == "player_1"
    assert env.observe("player_2") == []
    first = env.observe("player_1")
    assert first[0].content == "0 1 2\n3 4 5\n6 7 8\nLegal actions: 0, 1, 2, 3, 4, 5, 6, 7, 8. Reply with one of them."
    assert env.observe("player_1") == []
    result = await env.step(env.parse_action("I take 4"))
    assert result.messages == [] and result.agent_rewards is None
    seen = env.observe("player_2")[0].content.splitlines()
    assert seen[0] == "player_1 played 4." and seen[2] == "3 O 5"  # the opponent's mark, from player_2's view
    assert "4" not in seen[-1].split(":")[1]
    assert env.observe("player_2") == [] and env.observe("player_1") == []
    with pytest.raises(ValueError, match="unknown agent"):
        env.observe("player_3")


async def test_illegal_moves_never_reach_the_env_and_forfeit_after_the_retries() -> None:
    env = ttt(max_illegal_moves=1, illegal_move_penalty=-0.2)
    await env.reset({"id": "t", "seed": 0})
    await env.step(env.parse_action("4"))
    board_before = env.aec.observe("player_2")["observation"].tolist()
    result = await env.step(env.parse_action("4"))  # taken
    assert result.reward == -0.2 and not result.terminated and env.current_agent() == "player_2"
    assert "4 is not a legal action" in result.messages[0].content and "another illegal reply loses" in result.messages[0].content
    assert env.aec.observe("player_2")["observation"].tolist() == board_before
    result = await env.step(env.parse_action("no idea"))
    assert result.terminated and env.current_agent() is None
    assert result.agent_rewards == {"player_1": 1.0, "player_2": pytest.approx(-1.2)}
    assert result.info["winner"] == "player_1" and result.info["forfeit"] == "player_2"
    assert env.observe("player_1")[-1].content.endswith("Game over: player_1 wins.")
    with pytest.raises(RuntimeError, match="ended"):
        await env.step(env.parse_action("0"))


async def test_opponents_move_legally_and_deterministically() -> None:
    env = PettingZooEnv(PettingZooEnvConfig(make="pettingzoo.classic.connect_four_v3"), scripted=first_legal)
    await env.reset({"id": "c", "seed": 1})
    rng = random.Random(0)
    while (agent := env.current_agent()) is not None:
        mask = env.action_mask(agent)
        for kind in ("random", "scripted"):
            move = env.opponent_move(agent, kind, rng.randrange(1000))
            assert mask[int(move.content)] == 1
        assert env.opponent_move(agent, "random", 7) == env.opponent_move(agent, "random", 7)
        await env.step(env.opponent_move(agent, "scripted", 0))
    assert sum(env._game_returns.values()) == 0.0
    with pytest.raises(ValueError, match="unknown opponent kind"):
        await env.reset({"id": "c", "seed": 1})
        env.opponent_move("player_0", "frozen", 0)
    bare = ttt()
    await bare.reset({"id": "t", "seed": 0})
    with pytest.raises(ValueError, match="no scripted opponent"):
        bare.opponent_move("player_1", "scripted", 0)
    with pytest.raises(ValueError, match="is to act"):
        bare.opponent_move("player_2", "random", 0)


async def test_same_seed_same_game() -> None:
    env = ttt()
    runs = []
    for _ in range(2):
        played = await play(env, {"id": "t", "seed": 5}, {a: opponent("random", 9) for a in env.agents()})
        runs.append(played.conversations)
    assert runs[0] == runs[1]


async def test_hooks_from_config_strings() -> None:
    """YAML runs name render/parse/scripted as "module:function" strings."""
    hooks = types.ModuleType("pz_test_hooks")
    hooks.render = render_ttt  # type: ignore[attr-defined]
    hooks.scripted = first_legal  # type: ignore[attr-defined]
    hooks.parse = lambda agent, text, mask: {"centre": 4}.get(text.strip())  # type: ignore[attr-defined]
    sys.modules["pz_test_hooks"] = hooks
    try:
        env = PettingZooEnv(
            PettingZooEnvConfig(make=TTT, render="pz_test_hooks:render", parse="pz_test_hooks:parse", scripted="pz_test_hooks:scripted")
        )
        await env.reset({"id": "t", "seed": 0})
        assert env.observe("player_1")[0].content.startswith("0 1 2\n")
        assert (await env.step(env.parse_action("4"))).info["illegal"] is True  # this parse knows only "centre"
        await env.step(env.parse_action("centre"))
        env.observe("player_2")
        assert env.opponent_move("player_2", "scripted", 0).content == "0"
    finally:
        del sys.modules["pz_test_hooks"]


async def test_default_render_and_max_steps() -> None:
    env = PettingZooEnv(PettingZooEnvConfig(make=TTT, max_steps=3, announce_moves=False))
    played = await play(env, {"id": "t", "seed": 0}, {a: opponent("random", 0) for a in env.agents()})
    assert len(played.results) == 3 and played.last.truncated and played.last.truncation_reason == "max_steps"
    assert played.conversations["player_1"][0].content.startswith("Observation: [[[0, 0]")
    assert not any("played" in m.content for m in played.conversations["player_2"])
