"""The `propose_check` env: a proposer and a checker share the reward for the checker's final answer."""

from __future__ import annotations

import re

import pytest
from policy_engine import PolicyEngine

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.env import TurnTaking
from agentrl.envs.propose_check import ProposeCheckConfig, ProposeCheckEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.multi_agent import run_turns
from agentrl.rollout.roster import Roster

CONFIG = RolloutConfig(group_size=1, groups_per_step=1, max_turns=2)


def solve(prompt: str) -> str:
    """The right answer to the last problem in the prompt."""
    a, op, b = re.findall(r"Problem: What is (\d+) ([-+*]) (\d+)", prompt)[-1]
    return f"Answer: {eval(f'{a} {op} {b}')}"  # digits and one operator, matched above


def wrong(prompt: str) -> str:
    return "Answer: -999"


@pytest.mark.parametrize(
    ("proposer", "checker", "rewards"),
    [(solve, solve, (1.5, 1.0)), (wrong, solve, (1.0, 1.0)), (solve, wrong, (0.5, 0.0)), (wrong, wrong, (0.0, 0.0))],
)
async def test_both_share_the_final_answer_and_the_proposer_is_paid_for_its_own(
    proposer: object, checker: object, rewards: tuple[float, float]
) -> None:
    env = ProposeCheckEnv(ProposeCheckConfig(style="plain", n_train=5, n_test=2))
    assert isinstance(env, TurnTaking)
    tok = SimpleChatTokenizer()
    engine = PolicyEngine(tok, {"alice": proposer, "bob": checker})  # type: ignore[dict-item]
    engine.adapter_versions |= {"alice": 0, "bob": 0}
    task = next(iter(env.tasks("train")))
    roster = Roster(agents={"proposer": "alice", "checker": "bob"})
    trajs = await run_turns(env, task, engine, tok, CONFIG, roster, seed=0)
    assert [t.info["agent"] for t in trajs] == ["proposer", "checker"]
    assert tuple(t.reward for t in trajs) == rewards
    assert engine.asked == ["alice", "bob"]
    checker_text = " ".join(m.content for m in trajs[1].messages)
    assert "The proposer says: Answer:" in checker_text
    assert "The proposer says" not in " ".join(m.content for m in trajs[0].messages)


def test_the_splits_are_the_calculators_and_held_out() -> None:
    env = ProposeCheckEnv(ProposeCheckConfig(n_train=20, n_test=10))
    train = {t["expression"] for t in env.tasks("train")}
    test = {t["expression"] for t in env.tasks("test")}
    assert len(train) == 20 and len(test) == 10 and not train & test
