"""dataset env: local JSONL/Parquet files, column mapping, template, hashed splits, chosen rewards."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envs.dataset_env import DatasetEnv
from agentrl.types import Message

ROWS = [
    {"uid": f"q{i}", "problem": f"Tom has {i} apples and buys {i + 3} more. How many now?", "solution": str(2 * i + 3)}
    for i in range(40)
]


class LastNumber:
    """A minimal verifier: the last number in the reply equals task['answer']."""

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        numbers = re.findall(r"-?\d+", messages[-1].content)
        return RewardResult(value=float(bool(numbers) and numbers[-1] == task["answer"]))


class Length:
    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        return RewardResult(value=-len(messages[-1].content) / 100)


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*ROWS, ROWS[0]]) + "\n")  # one exact duplicate row
    return path


def make(path: Path, **params: object) -> DatasetEnv:
    config = DatasetEnv.Config(
        source={"path": str(path)},
        columns={"question": "problem", "answer": "solution"},
        prompt_template="Solve: {question}\nEnd with the number.",
        **params,
    )
    return DatasetEnv(config, rewards=[("last_number", 1.0, LastNumber())])


def test_hashed_split_is_deterministic_disjoint_and_deduplicated(jsonl: Path) -> None:
    env = make(jsonl, test_fraction=0.25)
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert len(train) + len(test) == 40  # the duplicate row was dropped
    assert test and not {t["id"] for t in train} & {t["id"] for t in test}
    # ids are content hashes: shuffling the file keeps ids and splits
    shuffled = jsonl.with_name("shuffled.jsonl")
    shuffled.write_text("\n".join(json.dumps(r) for r in reversed(ROWS)))
    again = make(shuffled, test_fraction=0.25)
    assert {t["id"] for t in again.tasks("test")} == {t["id"] for t in test}
    by_problem = {r["problem"]: r["solution"] for r in ROWS}
    assert all(t["answer"] == by_problem[t["question"]] for t in train + test)
    assert all(t["prompt"] == f"Solve: {t['question']}\nEnd with the number." for t in train)


async def test_single_turn_episode_scored_by_the_chosen_reward(jsonl: Path) -> None:
    env = make(jsonl, system_prompt="Be brief.", test_fraction=0.0)
    task = next(iter(env.tasks()))
    messages, _ = await env.reset(task)
    assert [m.role for m in messages] == ["system", "user"]
    assert messages[1].content == f"Solve: {ROWS[0]['problem']}\nEnd with the number."
    good = await env.step(Message(role="assistant", content=f"0 + 3 = {ROWS[0]['solution']}"))
    assert good.terminated and good.reward == 1.0 and good.reward_breakdown["last_number"] == 1.0
    await env.reset(task)
    bad = await env.step(Message(role="assistant", content="I think 7"))
    assert bad.terminated and bad.reward == 0.0


async def test_weighted_rewards_and_id_column_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    train_path, test_path = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:30]), train_path)
    pq.write_table(pa.Table.from_pylist(ROWS[30:]), test_path)
    config = DatasetEnv.Config(
        source={"path": str(train_path)}, test_source={"path": str(test_path)},
        columns={"question": "problem", "answer": "solution"}, id_column="uid",
    )
    env = DatasetEnv(config, rewards=[("exact", 1.0, LastNumber()), ("brevity", 0.5, Length())])
    assert [t["id"] for t in env.tasks("test")] == [f"q{i}" for i in range(30, 40)]
    task = next(iter(env.tasks("train")))
    assert task["id"] == "q0" and task["prompt"] == ROWS[0]["problem"]
    await env.reset(task)
    result = await env.step(Message(role="assistant", content="3"))
    assert result.reward == pytest.approx(1.0 - 0.5 * 0.01)
    assert result.reward_breakdown == {"exact": 1.0, "brevity": pytest.approx(-0.01)}


def test_config_errors_name_the_key(jsonl: Path) -> None:
    with pytest.raises(ValidationError, match=r"prompt_template uses \['solution'\]"):
        DatasetEnv.Config(source={"path": str(jsonl)}, prompt_template="{solution}")
    with pytest.raises(ValidationError, match="exactly one of `path`"):
        DatasetEnv.Config(source={})
    with pytest.raises(ValidationError, match="supported file types"):
        DatasetEnv.Config(source={"path": "data.txt"})
    env = DatasetEnv(DatasetEnv.Config(source={"path": str(jsonl)}, columns={"question": "nope"},
                                       prompt_template="{question}"), rewards=[])
    with pytest.raises(ValueError, match=r"columns.question='nope'.*it has: \['problem', 'solution', 'uid'\]"):
        list(env.tasks())
