"""The same calculator agent written with the OpenAI Agents SDK (`openai-agents`).

Only the model's client is agentrl's: `OpenAIChatCompletionsModel` over the
client `solve` receives. The two worked examples go in as input items.

    agentrl train examples/openai-agent/calculator.yaml env.agent=examples/openai-agent/agents_sdk.py:solve
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

sys.path.insert(0, str(Path(__file__).parent))
from agent import DEMOS, MAX_CALLS, SYSTEM, calculator, final_number


@function_tool(name_override="calculator")
def calculator_tool(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculator(expression)


def few_shot_items() -> list[Any]:
    items: list[Any] = []
    for i, (question, expression, answer) in enumerate(DEMOS):
        items += [
            {"role": "user", "content": question},
            {"type": "function_call", "call_id": f"demo-{i}", "name": "calculator",
             "arguments": json.dumps({"expression": expression})},
            {"type": "function_call_output", "call_id": f"demo-{i}", "output": str(answer)},
            {"role": "assistant", "content": f"Answer: {answer}"},
        ]
    return items


async def solve(task: dict[str, Any], client: Any) -> float:
    """Answer one word problem with the calculator; reward 1.0 for the right final number."""
    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculator_tool],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, [*few_shot_items(), {"role": "user", "content": task["prompt"]}],
                                  max_turns=MAX_CALLS)
    except MaxTurnsExceeded:
        return 0.0
    answer = final_number(str(result.final_output or ""))
    return 1.0 if answer is not None and abs(answer - float(task["answer"])) < 1e-6 else 0.0
