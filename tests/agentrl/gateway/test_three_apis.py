"""One conversation, three APIs, the same tokens: the same dialogue sent through Chat Completions, Responses and
Messages gives identical token ids, masks and logprobs, and an agent that rewrites its history branches the
same way in each (the APIs are translations onto one session core)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
from gateway_helpers import SYSTEM, TOOLS, calc

from agentrl.gateway import Gateway
from agentrl.types import Trajectory

pytestmark = pytest.mark.model
Ask = Callable[[str], Awaitable[str]]  # one question in, the final answer out (one tool loop)


async def chat_dialogue(gw: Gateway, session: Any) -> list[str]:
    client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
    answers = []
    for question in ("What is 7 * 6?", "What is 8 * 6?"):  # the second rewrites the history: a branch
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        for _ in range(3):
            r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            msg = r.choices[0].message
            calls = [c.model_dump() for c in msg.tool_calls or []]
            messages.append({"role": "assistant", "content": msg.content, **({"tool_calls": calls} if calls else {})})
            if not calls:
                answers.append(msg.content or "")
                break
            for c in calls:
                result = calc(json.loads(c["function"]["arguments"])["expression"])
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(result)})
    await client.close()
    return answers


async def responses_dialogue(gw: Gateway, session: Any) -> list[str]:
    client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
    tools: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    answers = []
    for question in ("What is 7 * 6?", "What is 8 * 6?"):
        items: list[Any] = [{"role": "user", "content": question}]
        for _ in range(3):
            r = await client.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools)
            items += [o.model_dump(exclude_none=True) for o in r.output]
            calls = [o for o in r.output if o.type == "function_call"]
            if not calls:
                answers.append(r.output_text)
                break
            for c in calls:
                result = calc(json.loads(c.arguments)["expression"])
                items.append({"type": "function_call_output", "call_id": c.call_id, "output": str(result)})
    await client.close()
    return answers


async def messages_dialogue(gw: Gateway, session: Any) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=f"{gw.url}/s/{session.id}", api_key=session.key, max_retries=0)
    tools: list[Any] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                         "input_schema": t["function"]["parameters"]} for t in TOOLS]
    answers = []
    for question in ("What is 7 * 6?", "What is 8 * 6?"):
        messages: list[Any] = [{"role": "user", "content": question}]
        for _ in range(3):
            r = await client.messages.create(model="m", max_tokens=96, system=SYSTEM, messages=messages, tools=tools)
            messages.append({"role": "assistant", "content": r.content})
            if r.stop_reason != "tool_use":
                answers.append(r.content[0].text)  # type: ignore[union-attr]
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": str(calc(b.input["expression"]))}
                for b in r.content if b.type == "tool_use"]})
    await client.close()
    return answers


def _shape(traj: Trajectory) -> tuple[Any, ...]:
    return (traj.token_ids, traj.loss_mask, traj.logprobs, [(t.start, t.end) for t in traj.turns],
            [m.role for m in traj.messages], traj.info.get("branch", {}).get("reason"))


async def test_same_dialogue_same_tokens_in_every_api(gateway: Gateway) -> None:
    shapes = {}
    for name, dialogue in (("chat", chat_dialogue), ("responses", responses_dialogue), ("messages", messages_dialogue)):
        session = gateway.open_session()
        assert await dialogue(gateway, session) == ["Answer: 42", "Answer: 48"], name
        trajs = session.trajectories(task={"id": "t"}, env="agent")
        assert len(trajs) == 2, (name, [t.info for t in trajs])  # the rewritten question opened a branch
        by_branch = sorted(trajs, key=lambda t: t.info["gateway"]["branch"])
        shapes[name] = [_shape(t) for t in by_branch]
    assert shapes["responses"] == shapes["chat"]
    assert shapes["messages"] == shapes["chat"]
    first, second = shapes["chat"]
    assert second[-1] == "message 1 (user) rewritten" and first[-1] is None
    assert first[4] == ["system", "user", "assistant", "tool", "assistant"]
