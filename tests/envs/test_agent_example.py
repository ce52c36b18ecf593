"""examples/openai-agent: one agent per API (the plain OpenAI-SDK agent on Chat Completions, the OpenAI Agents SDK
on Chat Completions and on its default Responses model, the anthropic SDK on Messages) solve calculator tasks
through the agent env (scripted model with SmolLM2's tokenizer) and get the native env's reward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envs.agent import AgentEnv, AgentEnvConfig
from agentrl.envs.calculator import CalculatorConfig, CalculatorEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager

EXAMPLE = Path(__file__).parents[2] / "examples" / "openai-agent"
PARAMS: dict[str, Any] = {"digits": 2, "num_operands": 2, "operators": ["+", "-", "*"], "style": "word", "n_train": 4}


@pytest.mark.model
@pytest.mark.parametrize("agent", ["agent.py:solve", "agents_sdk.py:solve", "responses_agent.py:solve",
                                   "anthropic_agent.py:solve"])
async def test_example_agents_solve_calculator_tasks(smollm2_path: str, agent: str) -> None:
    tasks = list(CalculatorEnv(CalculatorConfig(**PARAMS)).tasks("train"))
    expressions = {t["prompt"]: t["expression"] for t in tasks}

    def model(prompt: str) -> str:  # calls the calculator on the task's expression, then answers with the result
        last = prompt.split("<|im_start|>")[-2]
        if last.startswith("tool"):
            return "Answer: " + last.split("\n", 1)[1].split("<|im_end|>")[0].strip()
        question = last.split("\n", 1)[1].split("<|im_end|>")[0].strip()
        call = json.dumps({"name": "calculator", "arguments": {"expression": expressions[question]}})
        return f"<tool_call>\n{call}\n</tool_call>"

    tokenizer = HFChatTokenizer.from_pretrained(smollm2_path)
    engine = ScriptedEngine(tokenizer=tokenizer, reply_fn=model)
    config = AgentEnvConfig(agent=f"{EXAMPLE}/{agent}", tasks={"env": "calculator", "params": PARAMS},
                            gateway={"tools_in_prompt": False})
    rollout = RolloutConfig(group_size=2, groups_per_step=1, max_in_flight=8, max_staleness=8, max_turns=3,
                            max_new_tokens_per_turn=40, max_total_tokens=1024, sampling={"temperature": 0.7})
    env = AgentEnv(config)
    assert [t["id"] for t in env.tasks("train")] == [t["id"] for t in tasks]
    async with RolloutManager(lambda: AgentEnv(config), tasks, engine, tokenizer, rollout) as manager:
        groups = [g async for g in manager.groups()]
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and all(t.error is None and t.reward == 1.0 for t in trajs), [t.error for t in trajs]
    for traj in trajs:  # the few-shot turns are prompt; only the two sampled turns are trained
        assert len(traj.turns) == 2 and traj.prompt_messages == 10
        assert [m.role for m in traj.messages[-3:]] == ["assistant", "tool", "assistant"]
