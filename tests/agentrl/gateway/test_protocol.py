"""Bad input gets a clear 4xx and the gateway keeps serving; retries add nothing; rewrites branch; 64 sessions
at once do not mix."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from gateway_helpers import TOOLS, assert_token_exact, make_backend, openai_agent
from pydantic import ValidationError

from agentrl.gateway import Gateway, GatewayConfig

pytestmark = pytest.mark.model
USER = [{"role": "user", "content": "What is 1 + 2?"}]


async def _post(http: aiohttp.ClientSession, url: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) else None
    async with http.post(url, json=None if data is not None else body, data=data, headers=headers) as r:
        return r.status, await r.json()


async def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(gateway: Gateway) -> None:
    good = gateway.open_session()
    other = gateway.open_session()
    chat = f"{gateway.base_url(good)}/chat/completions"
    async with aiohttp.ClientSession() as http:
        cases: list[tuple[str, Any, str | None, int, str]] = [
            (chat, {"messages": USER, "n": 2}, good.key, 400, "n=2"),
            (chat, {"messages": USER, "temperature": 0.2}, good.key, 400, "temperature=0.2 differs from the trainer's temperature=1"),
            (chat, {"messages": USER, "top_p": 0.9}, good.key, 400, "top_p"),
            (chat, {"messages": USER, "presence_penalty": 0.5}, good.key, 400, "presence_penalty"),
            (chat, {"messages": USER, "tool_choice": "required", "tools": TOOLS}, good.key, 400, "tool_choice"),
            (chat, {"messages": []}, good.key, 400, "messages must be a non-empty list"),
            (chat, {"messages": [{"role": "robot", "content": "x"}]}, good.key, 400, "messages[0].role"),
            (chat, {"messages": USER, "max_tokens": 0}, good.key, 400, "max_tokens"),
            (chat, b"{not json", good.key, 400, "not valid JSON"),
            (chat, {"messages": USER, "pad": "x" * 70_000}, good.key, 413, "larger than the gateway's limit"),
            (f"{gateway.url}/s/nope/v1/chat/completions", {"messages": USER}, None, 404, "unknown session 'nope'"),
            (chat, {"messages": USER}, other.key, 401, "belongs to another session"),
            (f"{gateway.url}/v1/chat/completions", {"messages": USER}, "sk-wrong", 401, "unknown API key"),
        ]
        for url, body, key, status, words in cases:
            got, answer = await _post(http, url, body, key)
            assert got == status, (body if not isinstance(body, dict) else list(body), answer)
            assert words in answer["error"]["message"], answer
        got, answer = await _post(http, chat, {"messages": USER}, good.key)  # still serving
        assert got == 200 and answer["choices"][0]["message"]["tool_calls"]
        gateway.close_session(good)
        got, answer = await _post(http, chat, {"messages": USER}, good.key)
        assert got == 409 and "has ended" in answer["error"]["message"]
        got, answer = await _post(http, f"{gateway.url}/v1/chat/completions", {"messages": USER}, good.key)
        assert got == 409
        got, _ = await _post(http, f"{gateway.base_url(other)}/chat/completions", {"messages": USER}, other.key)
        assert got == 200


def test_other_addresses_need_a_token() -> None:
    with pytest.raises(ValidationError, match="not a loopback address"):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="::1").host == "::1"


async def test_token_guards_sessions(scripted: Any, chat_tokenizer: Any) -> None:

    token = "admin-token-0123456789"
    async with Gateway(GatewayConfig(token=token), make_backend(scripted, chat_tokenizer)) as gw, aiohttp.ClientSession() as http:
        status, _ = await _post(http, f"{gw.url}/sessions", {})
        assert status == 401
        status, opened = await _post(http, f"{gw.url}/sessions", {"id": "ep-1"}, token)
        assert status == 200 and opened["id"] == "ep-1" and opened["base_url"].endswith("/s/ep-1/v1")
        url = f"{opened['base_url']}/chat/completions"
        assert (await _post(http, url, {"messages": USER}, "anything"))[0] == 401
        assert (await _post(http, url, {"messages": USER}, opened["api_key"]))[0] == 200
        assert (await _post(http, f"{gw.url}/s/ep-1/reward", {"reward": "high"}, token))[0] == 400
        assert (await _post(http, f"{gw.url}/s/ep-1/reward", {"reward": 1.0}, token))[0] == 200
        status, closed = await _post(http, f"{gw.url}/s/ep-1/close", {}, token)
        assert status == 200 and closed["calls"] == 1 and closed["branches"] == 1
        assert (await _post(http, f"{gw.url}/s/ep-1/close", {}, token))[0] == 409


async def test_a_retried_request_adds_no_tokens(gateway: Gateway) -> None:
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    calls_before = gateway.backend.engine.calls  # type: ignore[attr-defined]
    first, again, concurrent = await asyncio.gather(
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS),  # type: ignore[arg-type]
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS),  # type: ignore[arg-type]
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=False),  # type: ignore[arg-type]
    )
    later = await client.chat.completions.create(model="m", messages=USER, tools=TOOLS)  # type: ignore[arg-type]
    await client.close()
    assert gateway.backend.engine.calls == calls_before + 1  # type: ignore[attr-defined]
    assert first.id == again.id == concurrent.id == later.id
    assert first.choices[0].message.tool_calls == later.choices[0].message.tool_calls
    [traj] = session.trajectories(task={}, env="agent")
    assert len(traj.turns) == 1 and session.calls == 1


async def test_rewritten_history_branches_and_extension_keeps_sampled_ids(gateway: Gateway) -> None:
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    _, sampled = await openai_agent(client, "What is 5 + 6?")
    # the agent now drops the tool turn and asks again: not an extension -> a new branch
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 9 + 9?"}], tools=TOOLS  # type: ignore[arg-type]
    )
    ids = r.choices[0].model_extra["token_ids"]  # type: ignore[index]
    await client.close()
    _, second = session.branches
    assert second.parent == 0 and second.reason == "message 0 (system) rewritten"
    trajs = session.trajectories(task={"id": "t"}, env="agent", reward=1.0)
    assert [t.info["gateway"]["branch"] for t in trajs] == [1, 0]  # the one that answered last comes first
    assert_token_exact(trajs[1], sampled)
    assert_token_exact(trajs[0], [ids])
    assert trajs[0].info["branch"] == {"parent": trajs[1].id, "reason": "message 0 (system) rewritten"}
    assert all(t.reward == 1.0 and t.task_id == "t" for t in trajs)


async def test_budget_exhaustion_is_a_4xx_that_marks_the_session_truncated(scripted: Any, chat_tokenizer: Any) -> None:

    from agentrl.chat.conversation import Budgets

    backend = make_backend(scripted, chat_tokenizer, budgets=Budgets(max_turns=1, max_total_tokens=4096))
    async with Gateway(GatewayConfig(), backend) as gw:
        session = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max_turns"):
            await openai_agent(client, "What is 1 + 1?")
        await client.close()
        [traj] = session.trajectories(task={}, env="agent")
        assert traj.truncated and traj.truncation_reason == "max_turns" and len(traj.turns) == 1


async def test_64_sessions_at_once_do_not_mix(gateway: Gateway) -> None:
    sessions = [gateway.open_session() for _ in range(64)]

    async def run(i: int) -> tuple[str, list[list[int]]]:
        s = sessions[i]
        async with openai.AsyncOpenAI(base_url=gateway.base_url(s), api_key=s.key, max_retries=0) as client:
            return await openai_agent(client, f"What is {i} + {1000 + i}?", stream=i % 2 == 1)

    results = await asyncio.gather(*(run(i) for i in range(64)))
    for i, (answer, sampled) in enumerate(results):
        assert answer == f"Answer: {1000 + 2 * i}"
        [traj] = sessions[i].trajectories(task={"id": str(i)}, env="agent")
        assert_token_exact(traj, sampled)
        assert traj.messages[1].content == f"What is {i} + {1000 + i}?"
        assert traj.messages[3].content == str(1000 + 2 * i)
        assert traj.messages[2].tool_calls[0].arguments == {"expression": f"{i} + {1000 + i}"}


async def test_same_tools_in_another_key_order_still_extend(gateway: Gateway) -> None:
    """Frameworks order a tool schema's keys differently; each order renders its own prompt and deltas
    (a template cache keyed by sorted JSON once mixed them up and refused the next call)."""
    reordered = [{"function": {"parameters": TOOLS[0]["function"]["parameters"], "description": TOOLS[0]["function"]["description"],
                               "name": "calculator"}, "type": "function"}]
    for tools in (TOOLS, reordered, TOOLS):
        session = gateway.open_session()
        client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 4 + 4?"}]
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools)  # type: ignore[arg-type]
        call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "8"}]
        r2 = await client.chat.completions.create(model="m", messages=messages, tools=tools)  # type: ignore[arg-type]
        await client.close()
        assert r2.choices[0].message.content == "Answer: 8"
        assert len(session.trajectories(task={}, env="agent")) == 1
