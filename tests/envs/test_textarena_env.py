"""The `textarena` env over real TextArena games (offline): TicTacToe, Nim, Kuhn poker, through the turn driver."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError
from turn_driver import opponent, play, replies

from agentrl.env import OpponentMoves, TurnTaking
from agentrl.envs.textarena_env import TextArenaConfig, TextArenaEnv
from agentrl.registry import Plugins

pytest.importorskip("textarena")


def arena(game: str = "TicTacToe-v0", **kw: object) -> TextArenaEnv:
    return TextArenaEnv(TextArenaConfig.model_validate({"game": game, **kw}))


def test_protocols_config_plugin_and_tasks() -> None:
    env = arena()
    assert isinstance(env, TurnTaking) and isinstance(env, OpponentMoves)
    assert env.agents() == ["player_0", "player_1"] and env.current_agent() is None
    assert Plugins.discover().envs.get("textarena") is TextArenaEnv
    with pytest.raises(ValidationError):
        TextArenaConfig.model_validate({"game": "Nim-v0", "extra": 1})
    train, test = list(arena(num_tasks=6).tasks("train")), list(arena(num_tasks=6).tasks("test"))
    assert not {t["seed"] for t in train} & {t["seed"] for t in test}
    assert [t["agent"] for t in train[:3]] == ["player_0", "player_1", "player_0"]


@pytest.mark.parametrize("game", ["TicTacToe-v0", "Nim-v0", "KuhnPoker-v0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_games_finish_zero_sum_with_a_consistent_winner(game: str, seed: int) -> None:
    env = arena(game)
    played = await play(env, {"id": "g", "seed": seed}, {a: opponent("random", seed) for a in env.agents()})
    last = played.last
    assert last.terminated and env.current_agent() is None
    assert all(r.info["illegal"] is False for _, r in played.results)  # the random opponent's moves are valid
    assert sum(played.returns.values()) == 0.0 and played.returns == last.info["outcome"]
    best = max(played.returns.values())
    expected = "draw" if list(played.returns.values()).count(best) > 1 else next(a for a, r in played.returns.items() if r == best)
    assert played.winner == expected


async def test_observe_once_and_moves_relayed_to_the_other_player() -> None:
    env = arena()
    opening, info = await env.reset({"id": "t", "seed": 0})
    assert opening == [] and info["first"] == "player_0"
    first = env.observe("player_0")[0].content
    assert "You are Player 0 in Tic Tac Toe" in first and "Available Moves: '[0]'" in first
    assert env.observe("player_0") == []
    result = await env.step(env.parse_action("4"))  # a bare move is bracketed: "[4]"
    assert result.info == {"agent": "player_0", "action": "[4]", "illegal": False} and result.messages == []
    other = env.observe("player_1")[0].content
    assert "You are Player 1" in other and "[Player 0] [4]" in other and "placed their symbol (O) in cell 4" in other
    own = env.observe("player_0")[0].content
    assert "[Player 0]" not in own  # its own move is not echoed back
    assert env.observe("player_0") == [] and env.observe("player_1") == []
    with pytest.raises(ValueError, match="unknown agent"):
        env.observe("player_9")


async def test_invalid_moves_are_corrected_then_lose() -> None:
    env = arena(max_illegal_moves=2, illegal_move_penalty=-0.3)
    moves = {"player_0": replies(["hello", "[42]", "still no"]), "player_1": replies([])}
    played = await play(env, {"id": "t", "seed": 0}, moves)
    (_, first), (_, second), (_, third) = played.results
    for result in (first, second):
        assert result.reward == -0.3 and not result.terminated and result.info["illegal"] is True
        assert "attempted an invalid move" in result.messages[0].content and "Available Moves" in result.messages[0].content
    assert third.terminated and third.info["winner"] == "player_1"
    assert third.agent_rewards == {"player_0": pytest.approx(-1.3), "player_1": 1.0}
    assert played.returns == pytest.approx({"player_0": -1.9, "player_1": 1.0})


async def test_an_episode_replays_from_its_seed_whatever_else_uses_random() -> None:
    """Kuhn poker deals from the global `random`; interleaved episodes and other users of it change nothing."""
    env, noisy = arena("KuhnPoker-v0"), arena("KuhnPoker-v0")
    alone = await play(env, {"id": "k", "seed": 11}, {a: opponent("random", 4) for a in env.agents()})

    await noisy.reset({"id": "k", "seed": 11})
    other = arena("KuhnPoker-v0")
    await other.reset({"id": "k2", "seed": 99})
    conversations: dict[str, list[str]] = {a: [] for a in noisy.agents()}
    turn = 0
    while (agent := noisy.current_agent()) is not None:
        random.random()  # someone else draws from the global random between steps
        conversations[agent] += [m.content for m in noisy.observe(agent)]
        if other.current_agent() is not None:
            await other.step(other.opponent_move(other.current_agent() or "", "random", turn))  # another game in flight
        await noisy.step(noisy.opponent_move(agent, "random", 4 * 1000 + turn))
        turn += 1
    assert conversations == {a: [m.content for m in c if m.role == "user"] for a, c in alone.conversations.items()}


async def test_opponent_kinds() -> None:
    env = arena("Nim-v0")
    await env.reset({"id": "n", "seed": 0})
    env.observe("player_0")
    assert env.candidate_moves("player_0") == ["[0 1]", "[0 2]", "[0 3]"] + [f"[1 {k}]" for k in range(1, 5)] + [
        f"[2 {k}]" for k in range(1, 6)
    ]
    with pytest.raises(ValueError, match="only kind 'random'"):
        env.opponent_move("player_0", "scripted", 0)
    with pytest.raises(ValueError, match="is to move"):
        env.opponent_move("player_1", "random", 0)
    moves = {env.opponent_move("player_0", "random", s).content for s in range(100)}
    assert len(moves) > 5 and moves <= set(env.candidate_moves("player_0"))
