"""The calculator agent on the `anthropic` SDK: the Messages API (`/v1/messages`), which the gateway serves.

A plain tool loop (`tool_use` blocks in, `tool_result` blocks back) as written
for Claude; only the base URL and key are agentrl's: `solve(task, base_url,
api_key)` gets this episode's gateway session (`base_url` ends in `/v1`; the
anthropic SDK adds `/v1/messages` itself).

    agentrl train examples/openai-agent/calculator.yaml env.agent=examples/openai-agent/anthropic_agent.py:solve
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anthropic

sys.path.insert(0, str(Path(__file__).parent))
from agent import DEMOS, MAX_CALLS, SYSTEM, TOOLS, calculator, final_number

CLAUDE_TOOLS: list[Any] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def few_shot() -> list[Any]:
    messages: list[Any] = []
    for i, (question, expression, answer) in enumerate(DEMOS):
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"demo-{i}", "name": "calculator",
                                               "input": {"expression": expression}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"demo-{i}", "content": str(answer)}]},
            {"role": "assistant", "content": f"Answer: {answer}"},
        ]
    return messages


async def solve(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Answer one word problem with the calculator; reward 1.0 for the right final number."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages: list[Any] = [*few_shot(), {"role": "user", "content": task["prompt"]}]
    try:
        for _ in range(MAX_CALLS):
            reply = await client.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=messages,
                                                 tools=CLAUDE_TOOLS)
            messages.append({"role": "assistant", "content": reply.content})
            if reply.stop_reason != "tool_use":
                break
            results = []
            for block in reply.content:
                if block.type == "tool_use":
                    expression = str(block.input.get("expression", "")) if isinstance(block.input, dict) else ""
                    results.append({"type": "tool_result", "tool_use_id": block.id, "content": calculator(expression)})
            messages.append({"role": "user", "content": results})
        else:
            return 0.0  # never gave a final answer
    finally:
        await client.close()
    text = "".join(b.text for b in reply.content if b.type == "text")
    answer = final_number(text)
    return 1.0 if answer is not None and abs(answer - float(task["answer"])) < 1e-6 else 0.0


if __name__ == "__main__":  # against any Messages-API server: python anthropic_agent.py URL KEY "question" answer
    import asyncio

    print(json.dumps(asyncio.run(solve({"prompt": sys.argv[3], "answer": sys.argv[4]}, sys.argv[1], sys.argv[2]))))
