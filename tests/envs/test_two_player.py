"""The `two_player` env (tic-tac-toe, Nim): full games through the TurnTaking driver, no model."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError
from turn_driver import opponent, play, replies

from agentrl.env import OpponentMoves, TurnTaking
from agentrl.envkit.check import acheck_env
from agentrl.envs.two_player import AGENTS, TwoPlayerConfig, TwoPlayerEnv, _ttt_winner
from agentrl.registry import Plugins
from agentrl.types import Message


def ttt(**kw: object) -> TwoPlayerEnv:
    return TwoPlayerEnv(TwoPlayerConfig.model_validate({"game": "tictactoe", **kw}))


def nim(**kw: object) -> TwoPlayerEnv:
    return TwoPlayerEnv(TwoPlayerConfig.model_validate({"game": "nim", **kw}))


def first_task(env: TwoPlayerEnv, split: str = "train", index: int = 0) -> dict[str, object]:
    return next(itertools.islice(env.tasks(split), index, None))


def replay_board(moves: list[int]) -> tuple[str, ...]:
    """An independent replay of a tic-tac-toe move list: X first, then O."""
    cells = [""] * 9
    for i, move in enumerate(moves):
        assert cells[move - 1] == "", f"move {move} played twice"
        cells[move - 1] = "XO"[i % 2]
    return tuple(cells)


# ---------------------------------------------------------------- contract and tasks


def test_protocols_and_plugin() -> None:
    env = ttt()
    assert isinstance(env, TurnTaking) and isinstance(env, OpponentMoves)
    assert env.agents() == ["player_0", "player_1"]
    assert env.current_agent() is None  # no game before reset
    assert Plugins.discover().envs.get("two_player") is TwoPlayerEnv
    with pytest.raises(ValidationError):
        TwoPlayerConfig.model_validate({"game": "chess"})
    with pytest.raises(ValidationError):
        TwoPlayerConfig.model_validate({"unknown": 1})
    with pytest.raises(ValidationError, match="min_stones"):
        TwoPlayerConfig.model_validate({"game": "nim", "min_stones": 9, "max_stones": 4})


def test_tasks_are_deterministic_held_out_and_alternate_seats() -> None:
    env = ttt(train_size=50, test_size=20, opening_moves=2)
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert train == list(env.tasks("train")) and len(train) == 50 and len(test) == 20
    assert not {t["seed"] for t in train} & {t["seed"] for t in test}
    assert len({t["id"] for t in train + test}) == 70
    assert [t["agent"] for t in train[:4]] == ["player_0", "player_1", "player_0", "player_1"]
    for task in train:
        opening = task["opening"]
        assert isinstance(opening, list) and len(opening) == 2 and len(set(opening)) == 2
        assert _ttt_winner(replay_board(opening)) is None
    assert len({tuple(t["opening"]) for t in train}) > 10  # the seeds vary the start  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        list(env.tasks("valid"))
    piles = [t["stones"] for t in nim(min_stones=6, max_stones=9, train_size=40).tasks("train")]
    assert set(piles) <= set(range(6, 10)) and len(set(piles)) > 1


async def test_check_env_passes() -> None:
    report = await acheck_env(ttt(train_size=8, test_size=2), n_episodes=2)
    assert report is not None


# ---------------------------------------------------------------- full games


@pytest.mark.parametrize("seed", range(30))
async def test_random_games_end_with_a_consistent_winner_and_zero_sum_rewards(seed: int) -> None:
    env = ttt(opening_moves=seed % 3)
    task = first_task(env, index=seed)
    played = await play(env, task, {a: opponent("random", seed) for a in AGENTS})
    last = played.last
    assert last.terminated and not last.truncated and env.current_agent() is None
    moves = last.info["moves"]
    assert isinstance(moves, list) and moves[: len(task["opening"])] == task["opening"]  # type: ignore[arg-type]
    result = _ttt_winner(replay_board(moves))  # type: ignore[arg-type]
    assert result is not None  # the game really is over
    expected = "draw" if result == -1 else AGENTS[result]
    assert played.winner == expected
    assert sum(played.returns.values()) == 0.0  # no illegal moves: exactly zero-sum
    if expected == "draw":
        assert played.returns == {"player_0": 0.0, "player_1": 0.0}
    else:
        loser = AGENTS[1 - AGENTS.index(expected)]
        assert played.returns == {expected: 1.0, loser: -1.0}
    assert last.agent_rewards == played.returns  # rewards only at the end
    assert all(r.agent_rewards is None and r.reward == 0.0 for _, r in played.results[:-1])


async def test_optimal_play_draws_and_never_loses() -> None:
    env = ttt(opening_moves=0)
    for seed in range(10):
        played = await play(env, first_task(env), {a: opponent("optimal", seed) for a in AGENTS})
        assert played.winner == "draw", played.last.info
    for seed, seat in itertools.product(range(20), AGENTS):
        movers = {a: opponent("optimal" if a == seat else "random", seed) for a in AGENTS}
        played = await play(env, first_task(env), movers)
        assert played.winner in (seat, "draw"), (seed, seat, played.last.info)


async def test_scripted_opponent_beats_random_and_loses_to_optimal_sometimes() -> None:
    """The scripted player is a real, beatable baseline: well above random, below perfect play."""
    env = ttt()
    wins = 0
    for seed, seat in itertools.product(range(40), AGENTS):
        movers = {a: opponent("scripted" if a == seat else "random", seed) for a in AGENTS}
        wins += (await play(env, first_task(env), movers)).winner == seat
    assert wins / 80 > 0.6  # random-vs-random wins about 0.58 as X and 0.29 as O
    outcomes = set()
    for seed in range(30):
        movers = {"player_0": opponent("optimal", seed), "player_1": opponent("scripted", seed)}
        outcomes.add((await play(env, first_task(env), movers)).winner)
    assert "player_1" not in outcomes and "player_0" in outcomes  # optimal X finds the forks scripted O allows


async def test_nim_optimal_player_wins_exactly_the_winning_starts() -> None:
    env = nim(min_stones=1, max_stones=25, max_take=3, train_size=60)
    for task in env.tasks("train"):
        stones = task["stones"]
        assert isinstance(stones, int)
        played = await play(env, task, {a: opponent("optimal", 1) for a in AGENTS})
        assert played.winner == ("player_0" if stones % 4 else "player_1"), task
        assert sum(played.returns.values()) == 0.0
        assert played.last.info["moves"] and sum(played.last.info["moves"]) == stones  # type: ignore[arg-type]


async def test_nim_messages_show_the_pile() -> None:
    env = nim(max_take=2)
    opening, _ = await env.reset({"id": "n", "game": "nim", "stones": 5})
    assert "1 to 2 stones" in opening[0].content
    first = env.observe("player_0")
    assert "Stones left: 5. You may take 1, 2." in first[0].content
    await env.step(Message(role="assistant", content="2"))
    assert env.observe("player_1")[0].content.startswith("Your opponent took 2.\nStones left: 3.")


# ---------------------------------------------------------------- messages, illegal moves


async def test_observe_returns_each_message_once_to_its_agent() -> None:
    env = ttt()
    opening, info = await env.reset(first_task(env))
    assert opening[0].role == "system" and "Tic-tac-toe" in opening[0].content and info["first"] == "player_0"
    assert env.observe("player_1") == []  # nothing to player_1 before it is its turn
    first = env.observe("player_0")
    assert len(first) == 1 and first[0].role == "user" and "You are X" in first[0].content
    assert env.observe("player_0") == []  # once
    result = await env.step(env.parse_action("5"))
    assert result.messages == [] and env.current_agent() == "player_1"
    seen = env.observe("player_1")
    assert seen[0].content.splitlines()[:2] == ["X marked 5.", "1 2 3"]
    assert "4 X 6" in seen[0].content and "Free cells: 1 2 3 4 6 7 8 9" in seen[0].content
    assert env.observe("player_1") == [] and env.observe("player_0") == []
    with pytest.raises(ValueError, match="unknown agent"):
        env.observe("player_2")


async def test_illegal_moves_are_corrected_penalised_and_bounded() -> None:
    env = ttt(max_illegal_moves=2, illegal_move_penalty=-0.25)
    await env.reset(first_task(env))
    env.observe("player_0")
    await env.step(env.parse_action("5"))
    assert "X marked 5." in env.observe("player_1")[0].content
    for reply, reason in (("hmm, let me think", "no cell number"), ("5", "cell 5 is taken")):
        result = await env.step(env.parse_action(reply))
        assert env.current_agent() == "player_1"  # same agent tries again
        assert result.reward == -0.25 and result.agent_rewards is None and not result.terminated
        assert result.info["illegal"] is True and reason in result.messages[0].content
        assert "Free cells" in result.messages[0].content
        assert env.observe("player_1") == []  # the correction came in the step, not again in observe
    assert "another illegal reply loses" in result.messages[0].content
    result = await env.step(env.parse_action("cell 42"))
    assert result.terminated and env.current_agent() is None
    assert result.info["winner"] == "player_0" and str(result.info["reason"]).startswith("forfeit")
    assert result.agent_rewards == {"player_1": -1.25, "player_0": 1.0}
    assert result.reward == -1.25
    with pytest.raises(RuntimeError, match="ended"):
        await env.step(env.parse_action("1"))


async def test_a_legal_move_resets_the_retry_count() -> None:
    env = ttt(max_illegal_moves=1)
    moves = {"player_0": replies(["x", "1", "y", "2", "z", "3"]), "player_1": replies(["q", "4", "w", "5"])}
    played = await play(env, first_task(env), moves)
    assert played.winner == "player_0" and played.last.info["reason"] == "three in a row"
    assert played.returns == pytest.approx({"player_0": 1.0 - 0.3, "player_1": -1.0 - 0.2})
    convo = played.conversations["player_1"]
    assert [m.role for m in convo] == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]


async def test_zero_retries_forfeit_at_once() -> None:
    env = ttt(max_illegal_moves=0)
    played = await play(env, first_task(env), {"player_0": replies(["no idea"]), "player_1": replies([])})
    assert played.winner == "player_1" and len(played.results) == 1


async def test_untrained_replies_cannot_stall_a_game() -> None:
    env = ttt()
    babble = replies(["I think the best move is to consider the board carefully."] * 100)
    played = await play(env, first_task(env), {"player_0": babble, "player_1": babble})
    assert len(played.results) == 3 and played.winner == "player_1"


# ---------------------------------------------------------------- determinism and opponents


async def test_same_task_and_seed_replay_identically() -> None:
    env = ttt(opening_moves=1)
    task = first_task(env, index=7)
    runs = []
    for _ in range(2):
        played = await play(env, task, {"player_0": opponent("random", 3), "player_1": opponent("scripted", 3)})
        runs.append((played.conversations, [(a, r.info, r.agent_rewards) for a, r in played.results]))
    assert runs[0] == runs[1]
    other = await play(env, task, {"player_0": opponent("random", 4), "player_1": opponent("scripted", 4)})
    assert runs[0][1] != [(a, r.info, r.agent_rewards) for a, r in other.results]  # the opponent seed matters


@pytest.mark.parametrize("game", ["tictactoe", "nim"])
async def test_opponent_moves_are_legal_in_every_position(game: str) -> None:
    env = TwoPlayerEnv(TwoPlayerConfig.model_validate({"game": game}))
    rng = random.Random(0)
    checked = 0
    for task in itertools.islice(env.tasks("train"), 40):
        await env.reset(task)
        while (agent := env.current_agent()) is not None:
            assert env._game is not None
            legal = env._game.legal()
            for kind in ("random", "scripted", "optimal"):
                move = env.opponent_move(agent, kind, rng.randrange(10**6))
                assert move.role == "assistant" and int(move.content) in legal, (kind, env.state_key())
                checked += 1
            other = AGENTS[1 - AGENTS.index(agent)]
            with pytest.raises(ValueError, match="is to move"):
                env.opponent_move(other, "random", 0)
            result = await env.step(env.opponent_move(agent, "random", rng.randrange(10**6)))
            assert result.info["illegal"] is False
    assert checked > 100
    with pytest.raises(ValueError, match="unknown opponent kind"):
        await env.reset(first_task(env))
        env.opponent_move("player_0", "frozen", 0)


async def test_random_opponent_covers_the_legal_moves() -> None:
    env = ttt()
    await env.reset(first_task(env))
    seen = {env.opponent_move("player_0", "random", s).content for s in range(200)}
    assert seen == {str(c) for c in range(1, 10)}


async def test_state_key_names_position_and_mover() -> None:
    env = ttt()
    await env.reset(first_task(env))
    assert env.state_key() == "tictactoe:.........:player_0"
    await env.step(env.parse_action("5"))
    assert env.state_key() == "tictactoe:....X....:player_1"


async def test_instructions_override_and_bad_tasks() -> None:
    env = ttt(instructions="")
    opening, _ = await env.reset(first_task(env))
    assert opening == []
    with pytest.raises(ValueError, match="ends the game"):
        await env.reset({"id": "t", "opening": [1, 4, 2, 5, 3]})
    with pytest.raises(ValueError, match="nim task"):
        await nim().reset({"id": "t", "game": "nim"})
    with pytest.raises(ValueError, match="plays tictactoe"):
        await env.reset({"id": "t", "game": "nim", "stones": 4})
