"""The calculator task as a plain OpenAI-SDK tool-calling agent.

Nothing here knows about agentrl: `solve` gets an `openai.AsyncOpenAI` client
(agentrl points it at its gateway) and a task dict, runs the usual
tool-calling loop and returns its reward. The same code runs against any
OpenAI-compatible server.

    agentrl train examples/openai-agent/calculator.yaml
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

SYSTEM = (
    'Use the calculator tool to compute, like this: <tool_call>\n{"name": "calculator", "arguments": '
    '{"expression": "2 + 3"}}\n</tool_call>\nThen give the final answer as: Answer: <number>'
)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
# two worked examples, as the native calculator env's `few_shot: 2` shows them
DEMOS: list[tuple[str, str, int]] = [
    ("Eli has 76 marbles. Eli uses 70 of them. How many marbles does Eli have at the end?", "76 - 70", 6),
    ("Gus starts with 36 books. Then 27 books are lost. How many books are there now?", "36 - 27", 9),
]
MAX_CALLS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: + - * / on numbers, evaluated without eval()."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))  # type: ignore[no-any-return]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("only numbers and + - * / are supported")

    try:
        value = walk(ast.parse(expression[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def few_shot() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, (question, expression, answer) in enumerate(DEMOS):
        call = {"id": f"demo-{i}", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"demo-{i}", "content": str(answer)},
            {"role": "assistant", "content": f"Answer: {answer}"},
        ]
    return messages


def final_number(text: str) -> float | None:
    """The number after the last "Answer:", else the last number in the text."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    numbers = re.findall(r"-?\d+(?:\.\d+)?", tail.replace(",", ""))
    return float(numbers[0] if "Answer:" in text and numbers else numbers[-1]) if numbers else None


async def solve(task: dict[str, Any], client: Any) -> float:
    """Answer one word problem with the calculator; reward 1.0 for the right final number."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *few_shot(),
                                      {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
                result = calculator(expression) if call.function.name == "calculator" else f"Error: unknown tool {call.function.name}"
            except (json.JSONDecodeError, AttributeError):
                result = "Error: the arguments are not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        return 0.0  # never gave a final answer
    answer = final_number(messages[-1].get("content") or "")
    return 1.0 if answer is not None and abs(answer - float(task["answer"])) < 1e-6 else 0.0
