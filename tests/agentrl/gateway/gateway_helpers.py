"""Shared pieces of the gateway tests: a scripted calculator model, agents written against the openai SDK,
and the token-exactness check every test applies to its trajectories."""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from agentrl.chat.conversation import Budgets
from agentrl.chat.tool_parsers import HermesParser
from agentrl.gateway import Backend, TrainerSampling
from agentrl.types import Trajectory

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
SYSTEM = "Use the calculator tool, then answer as: Answer: <number>"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> int:
    """A tiny safe evaluator for + - * on integers (the agents' tool)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        raise ValueError(f"unsupported expression {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def calculator_reply(prompt: str) -> str:
    """The scripted model: call the calculator on the last question, then answer with the tool's result."""
    turns = prompt.split("<|im_start|>")
    last = turns[-2] if len(turns) >= 2 else ""
    if last.startswith("tool"):
        return f"Answer: {last.split(chr(10), 1)[1].split('<|im_end|>')[0].strip()}"
    if last.startswith("user") and "again" in last:
        return "Sure, once more."
    questions = re.findall(r"What is ([0-9+*\- ]+)\?", prompt)
    expression = questions[-1].strip() if questions else "1 + 1"
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


async def openai_agent(client: Any, question: str, *, stream: bool = False, turns: int = 4) -> tuple[str, list[list[int]]]:
    """A plain tool-calling loop on `openai.AsyncOpenAI`; returns the answer and each call's sampled ids."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    sampled: list[list[int]] = []
    for _ in range(turns):
        if stream:
            content, calls, ids = await _streamed(client, messages)
        else:
            r = await client.chat.completions.create(model="agentrl", messages=messages, tools=TOOLS, logprobs=True)
            msg = r.choices[0].message
            content, calls = msg.content, [c.model_dump() for c in msg.tool_calls or []]
            ids = r.choices[0].model_extra["token_ids"]
        sampled.append(ids)
        messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        if not calls:
            return content or "", sampled
        for call in calls:
            result = calc(json.loads(call["function"]["arguments"])["expression"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
    return "", sampled


async def _streamed(client: Any, messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], list[int]]:
    """Accumulate a streamed answer the way agent code does (content deltas, tool-call deltas by index)."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    ids: list[int] = []
    stream = await client.chat.completions.create(model="agentrl", messages=messages, tools=TOOLS, stream=True)
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
        if choice.finish_reason is not None:
            ids = (choice.model_extra or {})["token_ids"]
    return content, [calls[i] for i in sorted(calls)], ids


def assert_token_exact(traj: Trajectory, sampled: list[list[int]]) -> None:
    """The trajectory's model tokens are exactly the engine's sampled ids, turn by turn, and the mask covers
    exactly those tokens."""
    assert [traj.token_ids[t.start : t.end] for t in traj.turns] == sampled
    covered = {i for t in traj.turns for i in range(t.start, t.end)}
    assert [i for i, m in enumerate(traj.loss_mask) if m] == sorted(covered)
    assert [x for x, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == [i for ids in sampled for i in ids]
    assert all(v >= 0 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m)
    assert "retokenization_drift" in traj.metrics


class RecordingEngine:
    """Wraps an engine and keeps the ids of every completion it returned (what the engine sampled)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sampled: list[list[int]] = []
        self.policy_version = engine.policy_version

    async def generate(self, prompt_ids: Any, sampling: Any) -> Any:
        completion = await self.engine.generate(prompt_ids, sampling)
        self.sampled.append(list(completion.ids))
        return completion

    async def update_weights(self, weights: Any, version: int) -> None:
        await self.engine.update_weights(weights, version)

    async def health(self) -> Any:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()


def make_backend(engine: Any, tokenizer: Any, **kw: Any) -> Backend:
    """A gateway backend over `engine` with the tests' budgets and the trainer's sampling (temperature 1)."""
    budgets = kw.pop("budgets", Budgets(max_turns=8, max_total_tokens=4096, max_new_tokens_per_turn=96))
    return Backend(engine=engine, tokenizer=tokenizer, parser=HermesParser(),
                   sampling=kw.pop("sampling", TrainerSampling(temperature=1.0)), budgets=budgets, **kw)
