"""The `agent` env: unmodified OpenAI-SDK agent code run per episode under the rollout manager.

The solve functions below are the "user's agent"; the env loads them from this file by path.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "agentrl" / "gateway"))

from gateway_helpers import TOOLS, assert_token_exact, calc, calculator_reply, openai_agent

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import EpisodeDriver
from agentrl.envs.agent import AgentEnv, AgentEnvConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import ErrorClass, Group

TASKS = [{"id": f"q{i}", "question": f"What is {a} + {b}?", "answer": a + b} for i, (a, b) in enumerate([(12, 30), (7, 8)])]


async def solve(task: dict[str, Any], client: Any) -> float:
    """A plain openai-SDK tool loop; the reward is whether the answer is right."""
    answer, _ = await openai_agent(client, task["question"])
    return 1.0 if answer == f"Answer: {task['answer']}" else 0.0


async def solve_summarising(task: dict[str, Any], client: Any) -> dict[str, float]:
    """Calls the calculator, then *rewrites* its history (a summary instead of the tool turn) before answering."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    value = calc(json.loads(call.function.arguments)["expression"])
    summary = [{"role": "user", "content": f"{task['question']} (the calculator said {value})"},
               {"role": "assistant", "content": "Let me check."}, {"role": "tool", "tool_call_id": "x", "content": str(value)}]
    r2 = await client.chat.completions.create(model="m", messages=summary, tools=TOOLS)
    found = re.findall(r"-?\d+", r2.choices[0].message.content or "")
    return {"correct": float(bool(found) and int(found[-1]) == task["answer"]), "style": 0.25}


async def solve_posting(task: dict[str, Any], base_url: str, api_key: str) -> None:
    """Takes a base URL (no openai client), gives per-turn and episode rewards over HTTP, returns None."""
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": task["question"]}]}
        assert (await http.post("/chat/completions", json=body)).status_code == 200
        root = base_url.removesuffix("/v1")
        assert (await http.post(f"{root}/reward", json={"reward": 0.5, "turn": 0})).status_code == 200
        assert (await http.post(f"{root}/reward", json={"reward": 0.75, "breakdown": {"judge": 0.75}})).status_code == 200


async def solve_silent(task: dict[str, Any], client: Any) -> None:
    """Returns no reward: the env's reward plugins score the final messages."""
    await openai_agent(client, task["question"])


async def solve_crashing(task: dict[str, Any], client: Any) -> float:
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["question"]}])
    raise RuntimeError("the agent's own bug")


def _env(agent: str, **kw: Any) -> AgentEnv:
    return AgentEnv(AgentEnvConfig(agent=f"{__file__}:{agent}", tasks=TASKS, **kw))


async def _groups(agent: str, engine: Any, tokenizer: Any, env: dict[str, Any] | None = None, **kw: Any) -> list[Group]:
    config = RolloutConfig(group_size=2, groups_per_step=2, max_in_flight=4, max_staleness=4, max_turns=4,
                           max_new_tokens_per_turn=64, max_total_tokens=2048, **kw)
    async with RolloutManager(lambda: _env(agent, **(env or {})), TASKS, engine, tokenizer, config) as manager:
        return [g async for g in manager.groups()]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> HFChatTokenizer:
    return HFChatTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def engine(tokenizer: HFChatTokenizer) -> ScriptedEngine:
    return ScriptedEngine(ScriptedEngine.Config(logprob=-0.25), tokenizer=tokenizer, reply_fn=calculator_reply)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="agent="):
        AgentEnvConfig(agent="no_colon", tasks=TASKS)
    with pytest.raises(ValueError, match="is not a loopback address"):
        AgentEnvConfig(agent="m:solve", tasks=TASKS, gateway={"host": "0.0.0.0"})
    assert AgentEnvConfig(agent="m:solve", tasks=TASKS, gateway={"host": "0.0.0.0", "token": "t" * 16}).gateway.token


@pytest.mark.model
async def test_groups_of_agent_episodes_are_token_exact(engine: ScriptedEngine, tokenizer: HFChatTokenizer) -> None:
    assert isinstance(_env("solve"), EpisodeDriver)
    groups = await _groups("solve", engine, tokenizer)
    assert sorted(g.task_id for g in groups) == ["q0", "q1"]
    for group in groups:
        assert [t.sample_index for t in group.trajectories] == [0, 1]
        for traj in group.trajectories:
            assert traj.error is None and traj.reward == 1.0 and traj.env == "agent"
            assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
            sampled = [traj.token_ids[t.start : t.end] for t in traj.turns]
            assert_token_exact(traj, sampled)
            prompt = tokenizer.decode(traj.token_ids[: traj.turns[0].start])
            assert sampled[0] == [*tokenizer.encode(calculator_reply(prompt)), tokenizer.eos_ids[0]]
            assert traj.metrics["retokenization_drift"] >= 0.0
            assert set(traj.logprobs[i] for i, m in enumerate(traj.loss_mask) if m) == {-0.25}


@pytest.mark.model
async def test_history_rewrite_makes_a_branch_in_the_same_group(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, tmp_path: Path
) -> None:
    groups = await _groups("solve_summarising", engine, tokenizer)
    for group in groups:
        assert len(group.trajectories) == 4  # 2 samples x (main + branch)
        for index in (0, 1):
            main, branch = [t for t in group.trajectories if t.sample_index == index]
            assert main.info["gateway"]["main"] and not branch.info["gateway"]["main"]
            assert "branch" not in branch.info and main.info["branch"]["parent"] == branch.id  # main forked off the first
            assert main.info["branch"]["reason"] == "message 0 (user) rewritten"
            assert main.reward == branch.reward == 1.25 and main.reward_breakdown == {"correct": 1.0, "style": 0.25}
            assert main.info["gateway"]["session"] == branch.info["gateway"]["session"]
            for traj in (main, branch):  # each branch is its own sample: its prompt masked, its turns sampled
                assert len(traj.turns) == 1
                assert_token_exact(traj, [traj.token_ids[traj.turns[0].start : traj.turns[0].end]])
    store = TrajectoryStore(tmp_path / "store.db")
    for group in groups:
        store.add_group(group, step=0)
    store.commit()
    listed = {r.trajectory.id: r.trajectory for r in store.iter_records()}
    assert len(listed) == 8
    branches = [t for t in listed.values() if "branch" in t.info]
    assert len(branches) == 4 and all(t.info["branch"]["parent"] in listed for t in branches)
    store.close()


@pytest.mark.model
async def test_base_url_agent_with_posted_rewards(engine: ScriptedEngine, tokenizer: HFChatTokenizer) -> None:
    groups = await _groups("solve_posting", engine, tokenizer)
    traj = groups[0].trajectories[0]
    assert traj.reward == 0.75 and traj.reward_breakdown == {"judge": 0.75}
    assert [t.reward for t in traj.turns] == [0.5]


@pytest.mark.model
async def test_agent_crash_is_a_classified_failure(engine: ScriptedEngine, tokenizer: HFChatTokenizer) -> None:
    """An agent that raises fails its episode (env class) without stopping the run; zero_reward keeps it."""
    groups = await _groups("solve_crashing", engine, tokenizer, on_error={"env": "zero_reward"})
    assert len(groups) == 2
    for traj in (t for g in groups for t in g.trajectories):
        assert traj.error is not None and traj.error.kind is ErrorClass.ENV and "the agent's own bug" in traj.error.message
        assert traj.reward == 0.0 and traj.num_sampled_tokens > 0


@pytest.mark.model
async def test_reward_plugins_score_the_final_messages(engine: ScriptedEngine, tokenizer: HFChatTokenizer) -> None:
    groups = await _groups("solve_silent", engine, tokenizer, env={"rewards": [{"name": "math"}]})
    for traj in (t for g in groups for t in g.trajectories):
        assert traj.error is None and traj.reward == 1.0
        assert traj.reward_breakdown["math"] == 1.0 and traj.reward_breakdown["correct"] == 1.0


@pytest.mark.model
async def test_an_agent_cut_off_by_the_turn_budget_ends_truncated(engine: ScriptedEngine, tokenizer: HFChatTokenizer) -> None:
    """max_turns=1: the agent's second call is refused; the episode is truncated with reward 0, not a failure."""
    config = RolloutConfig(group_size=1, groups_per_step=1, max_turns=1, max_new_tokens_per_turn=64)
    async with RolloutManager(lambda: _env("solve"), TASKS[:1], engine, tokenizer, config) as manager:
        [group] = [g async for g in manager.groups()]
    [traj] = group.trajectories
    assert traj.error is None and traj.truncated and traj.truncation_reason == "max_turns" and traj.reward == 0.0
    assert len(traj.turns) == 1


async def solve_without_calling(task: dict[str, Any], client: Any) -> float:
    raise TimeoutError("the agent hung before asking the model")


@pytest.mark.model
async def test_failures_before_any_answer_never_hand_the_trainer_an_empty_sample(tokenizer: HFChatTokenizer) -> None:
    """An engine failing on the first call: the prompt alone is kept (engine class); no call at all: an env failure."""
    failing = ScriptedEngine(ScriptedEngine.Config(error_rate=1.0), tokenizer=tokenizer)
    groups = await _groups("solve", failing, tokenizer, on_error={"engine": "zero_reward"})
    for traj in (t for g in groups for t in g.trajectories):
        assert traj.error is not None and traj.error.kind is ErrorClass.ENGINE
        assert len(traj.token_ids) > 2 and traj.num_sampled_tokens == 0 and traj.turns == []
    engine = ScriptedEngine(tokenizer=tokenizer)
    groups = await _groups("solve_without_calling", engine, tokenizer, on_error={"env": "zero_reward", "timeout": "zero_reward"})
    for traj in (t for g in groups for t in g.trajectories):
        assert traj.error is not None and traj.error.kind is ErrorClass.ENV and "made no model call" in traj.error.message
