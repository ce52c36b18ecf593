"""The reasoning_gym env: deterministic tasks, disjoint splits, the dataset's own scorer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.envs.reasoning_gym_env import ReasoningGymEnv
from agentrl.types import Message


def make(**params: object) -> ReasoningGymEnv:
    return ReasoningGymEnv(ReasoningGymEnv.Config(**params))


def test_tasks_are_deterministic_and_splits_disjoint() -> None:
    env = make(train_size=50, test_size=20, seed=3)
    train = list(env.tasks("train"))
    again = list(make(train_size=50, test_size=20, seed=3).tasks("train"))
    assert [t["id"] for t in train] == [t["id"] for t in again]
    assert [t["question"] for t in train] == [t["question"] for t in again]
    test = list(env.tasks("test"))
    assert 0 < len(test) <= 20
    assert not {t["question"] for t in test} & {t["question"] for t in train}
    assert len({t["id"] for t in train + test}) == len(train) + len(test)
    with pytest.raises(ValueError, match="split='dev'"):
        list(env.tasks("dev"))


async def test_correct_wrong_and_unformatted_answers() -> None:
    env = make(train_size=5, test_size=0)
    task = next(iter(env.tasks()))
    messages, _ = await env.reset(task)
    assert messages[0].role == "system" and "<answer>" in messages[0].content
    assert messages[-1] == Message(role="user", content=task["question"])

    right = await env.step(Message(role="assistant", content=f"so <answer>{task['answer']}</answer>"))
    assert right.terminated and right.reward == 1.0

    await env.reset(task)
    wrong = await env.step(Message(role="assistant", content="<answer>banana</answer>"))
    assert wrong.terminated and wrong.reward == 0.0
    # the dataset's own scorer gives partial credit for near misses
    await env.reset(task)
    near = await env.step(Message(role="assistant", content=f"<answer>{task['answer']}1</answer>"))
    assert 0.0 < near.reward < 1.0

    await env.reset(task)
    plain = await env.step(Message(role="assistant", content=str(task["answer"])))
    assert plain.reward == 0.0 and plain.info["format_error"] is True


async def test_other_dataset_with_params() -> None:
    env = make(dataset="leg_counting", dataset_params={"min_animals": 1, "max_animals": 2}, train_size=3, test_size=0)
    task = next(iter(env.tasks()))
    await env.reset(task)
    result = await env.step(Message(role="assistant", content=f"<answer>{task['answer']}</answer>"))
    assert result.reward == 1.0


def test_bad_config_names_the_key() -> None:
    with pytest.raises(ValidationError, match=r"basic_arithmetc.*closest: basic_arithmetic"):
        make(dataset="basic_arithmetc")
    with pytest.raises(ValidationError, match="bogus"):
        make(bogus=1)
    with pytest.raises(ValueError, match="dataset_params for 'basic_arithmetic'"):
        list(make(dataset_params={"nope": 1}).tasks())


async def test_the_default_prompt_asks_for_the_configured_tag() -> None:
    env = make(train_size=5, test_size=0, answer_tag="final")
    task = next(iter(env.tasks()))
    messages, _ = await env.reset(task)
    assert "<final>" in messages[0].content and "<answer>" not in messages[0].content
    right = await env.step(Message(role="assistant", content=f"<final>{task['answer']}</final>"))
    assert right.reward == 1.0
    own = make(train_size=5, test_size=0, answer_tag="final", system_prompt="Answer in <final>.")
    assert (await own.reset(task))[0][0].content == "Answer in <final>."  # a prompt of one's own is kept
