"""The calculator agent on the OpenAI Agents SDK with its default model, `OpenAIResponsesModel`: it speaks
the Responses API (`/v1/responses`), which the gateway serves.

Only the model's client is agentrl's (the one `solve` receives, bound to this
episode's gateway session); the worked examples go in as input items.

    agentrl train examples/openai-agent/calculator.yaml env.agent=examples/openai-agent/responses_agent.py:solve
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agents import Agent, MaxTurnsExceeded, OpenAIResponsesModel, Runner, set_tracing_disabled

sys.path.insert(0, str(Path(__file__).parent))
from agent import MAX_CALLS, SYSTEM, final_number
from agents_sdk import calculator_tool, few_shot_items


async def solve(task: dict[str, Any], client: Any) -> float:
    """Answer one word problem with the calculator; reward 1.0 for the right final number."""
    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculator_tool],
                  model=OpenAIResponsesModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, [*few_shot_items(), {"role": "user", "content": task["prompt"]}],
                                  max_turns=MAX_CALLS)
    except MaxTurnsExceeded:
        return 0.0
    answer = final_number(str(result.final_output or ""))
    return 1.0 if answer is not None and abs(answer - float(task["answer"])) < 1e-6 else 0.0
