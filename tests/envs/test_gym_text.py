"""gym_text: boards rendered as text, actions parsed from replies, rewards from the game."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.envs.gym_text import GymTextEnv
from agentrl.types import Message


def make(**params: object) -> GymTextEnv:
    return GymTextEnv(GymTextEnv.Config(**params))


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


def test_task_ids_deterministic_and_splits_disjoint() -> None:
    env = make(train_size=30, test_size=10, seed=2)
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert [t["id"] for t in train] == [t["id"] for t in make(train_size=30, test_size=10, seed=2).tasks()]
    assert not {t["seed"] for t in train} & {t["seed"] for t in test}
    with pytest.raises(ValueError, match="allowed: train, test"):
        list(env.tasks("val"))


async def test_frozenlake_solved_by_following_the_rendered_board(shortest_lake_path: Any) -> None:
    env = make(game="frozenlake", max_steps=30)
    task = next(iter(env.tasks()))
    messages, _ = await env.reset(task)
    board = messages[0].content.split("\n\n")[-1].splitlines()
    assert board == env.render().splitlines() and board[0][0] == "P"
    path = shortest_lake_path(board)
    total = 0.0
    for i, move in enumerate(path):
        result = await env.step(say(f"I will go {move}. <action>{move}</action>"))
        total += result.reward
        assert result.terminated == (i == len(path) - 1)
        if not result.terminated:
            assert "P" in result.messages[0].content
    assert total == 1.0 and result.messages == []


async def test_frozenlake_hole_ends_with_zero_and_bad_action_does_not_move() -> None:
    env = make(game="frozenlake", train_size=50)
    for task in env.tasks():
        await env.reset(task)
        board = env.render().splitlines()
        if board[0][1] == "H":
            break
    else:
        pytest.skip("no map with a hole right of the start")
    bad = await env.step(say("<action>jump</action>"))
    assert bad.info["invalid_action"] and not bad.terminated and env.render().splitlines() == board
    fell = await env.step(say("right"))
    assert fell.terminated and fell.reward == 0.0


async def test_taxi_rewards_and_truncation() -> None:
    env = make(game="taxi", max_steps=3)
    await env.reset(next(iter(env.tasks())))
    assert "T" in env.render() and "Destination:" in env.render()
    illegal = await env.step(say("<action>dropoff</action>"))
    assert illegal.reward == -10.0 and not illegal.terminated
    move = await env.step(say("<action>north</action> or maybe west"))  # the tag wins over bare words
    assert move.info["action"] == "north" and move.reward == -1.0
    last = await env.step(say("<action>south</action>"))
    assert last.truncated and not last.terminated and last.messages == []
    assert last.truncation_reason == "max_steps"


async def test_blackjack_stick_ends_with_game_reward() -> None:
    env = make(game="blackjack", train_size=20)
    outcomes = set()
    for task in env.tasks():
        messages, _ = await env.reset(task)
        assert "Dealer shows:" in messages[0].content
        result = await env.step(say("I stick. <action>stick</action>"))
        assert result.terminated
        outcomes.add(result.reward)
    assert outcomes <= {-1.0, 0.0, 1.0} and len(outcomes) >= 2


async def test_sample_seed_keeps_the_start_but_varies_later_cards() -> None:
    env = make(game="blackjack", train_size=1)
    task = next(iter(env.tasks()))
    starts, hands = set(), set()
    for sample_seed in range(12):
        messages, _ = await env.reset(task, seed=sample_seed)
        starts.add(messages[0].content)
        result = await env.step(say("<action>hit</action>"))
        hands.add(result.info.get("final_state") or result.messages[0].content)
    again, _ = await env.reset(task, seed=0)
    assert len(starts) == 1 and again[0].content in starts
    assert len(hands) > 1


async def test_too_many_invalid_replies_truncate() -> None:
    env = make(game="taxi", max_invalid_actions=2)
    await env.reset(next(iter(env.tasks())))
    results = [await env.step(say("hmm")) for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert results[-1].truncation_reason == "invalid_actions" and results[-1].messages == []


async def test_frozenlake_neighbours_line_names_what_each_move_leads_to() -> None:
    env = make(game="frozenlake", show_neighbours=True, train_size=50)
    for task in env.tasks():
        await env.reset(task)
        board = env.render().splitlines()
        if board[1][0] == "H":
            break
    else:
        pytest.skip("no map with a hole below the start")
    assert len(board) == 5
    assert board[-1] == f"Moves: left=wall down=hole right={'hole' if board[0][1] == 'H' else 'ice'} up=wall"
    moved = await env.step(say("<action>left</action>"))  # into the wall: stays, the line stays
    assert moved.messages[0].content.splitlines()[-1] == board[-1]


async def test_frozenlake_demonstrations_replay_to_the_goal_on_train_boards() -> None:
    env = make(game="frozenlake", show_neighbours=True, demonstrations=5, test_size=5)
    demos = env.demonstrations()
    train_ids = [t["id"] for t in env.tasks("train")][:5]
    assert len(demos) == 5 and not make(game="frozenlake").demonstrations()
    for task_id, demo in zip(train_ids, demos, strict=True):
        task = next(t for t in env.tasks("train") if t["id"] == task_id)
        messages, _ = await env.reset(task)
        assert messages[0] == demo[0]  # the demo is the conversation an episode on that board has
        result = None
        for i in range(1, len(demo), 2):
            assert demo[i].role == "assistant" and demo[i].content.startswith("<action>")
            result = await env.step(demo[i])
            if i + 1 < len(demo):
                assert result.messages[0] == demo[i + 1]
        assert result is not None and result.terminated and result.reward == 1.0


async def test_frozenlake_few_shot_games_precede_the_held_out_board() -> None:
    env = make(game="frozenlake", few_shot=2, test_size=3)
    task = next(iter(env.tasks("test")))
    messages, _ = await env.reset(task)
    shots = env.demonstrations() or make(game="frozenlake", demonstrations=2).demonstrations()
    assert messages[:-1] == [m for demo in shots for m in demo]
    assert messages[-1].role == "user" and messages[-1].content == "New board.\n" + env.render()
    assert (await make(game="frozenlake", test_size=3).reset(task))[0][0].content.endswith(env.render())
