"""The real `anthropic` SDK through the gateway's `/v1/messages`: a hand-written tool loop (streamed and not) and
the SDK's own tool runner (server-held threads), unmodified but for base URL and key. Every trajectory holds
exactly the sampled ids, in one branch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest
from gateway_helpers import SYSTEM, RecordingEngine, assert_token_exact, calc, make_backend

from agentrl.gateway import Gateway, GatewayConfig

pytestmark = pytest.mark.model
TOOLS: list[Any] = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
                     "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                                      "required": ["expression"]}}]


@pytest.fixture
async def recorded(scripted: Any, chat_tokenizer: Any) -> AsyncIterator[tuple[Gateway, RecordingEngine]]:
    engine = RecordingEngine(scripted)
    async with Gateway(GatewayConfig(), make_backend(engine, chat_tokenizer)) as gw:
        yield gw, engine


def _client(gw: Gateway, session: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"{gw.url}/s/{session.id}", api_key=session.key, max_retries=0)


def _one_branch(session: Any, engine: RecordingEngine) -> Any:
    trajs = session.trajectories(task={"id": "t"}, env="agent")
    assert len(trajs) == 1, [t.info for t in trajs]
    assert_token_exact(trajs[0], engine.sampled)
    return trajs[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_loop_with_content_blocks(recorded: tuple[Gateway, RecordingEngine], stream: bool) -> None:
    gw, engine = recorded
    session = gw.open_session()
    client = _client(gw, session)
    messages: list[Any] = [{"role": "user", "content": "What is 7 * 6?"}]
    replies = []
    for _ in range(3):
        if stream:
            async with client.messages.stream(model="agentrl", max_tokens=64, system=SYSTEM, messages=messages,
                                              tools=TOOLS) as events:
                kinds = [event.type async for event in events]
                reply = await events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        else:
            reply = await client.messages.create(model="agentrl", max_tokens=64, system=SYSTEM, messages=messages,
                                                 tools=TOOLS)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": str(calc(b.input["expression"]))}
            for b in reply.content if b.type == "tool_use"]})
    await client.close()
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    [use] = replies[0].content
    assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "7 * 6"}
    assert [b.type for b in replies[1].content] == ["text"] and replies[1].content[0].text == "Answer: 42"
    assert replies[1].usage.output_tokens == len(engine.sampled[1])
    traj = _one_branch(session, engine)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj.messages[3].tool_call_id == use.id == traj.messages[2].tool_calls[0].id
    assert replies[1].usage.input_tokens == traj.turns[1].start


@pytest.mark.parametrize("stream", [False, True])
async def test_sdk_tool_runner_on_threads(recorded: tuple[Gateway, RecordingEngine], stream: bool) -> None:
    """The SDK's tool runner holds the conversation on the server (`thread`) and sends only new messages: the
    gateway keeps each reply's thread, so the run is still one token-exact conversation."""
    from anthropic import beta_async_tool

    gw, engine = recorded

    @beta_async_tool
    async def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the arithmetic expression
        """
        return str(calc(expression))

    session = gw.open_session()
    client = _client(gw, session)
    runner = client.beta.messages.tool_runner(model="agentrl", max_tokens=64, system=SYSTEM, tools=[calculator],
                                              messages=[{"role": "user", "content": "What is 12 + 34?"}],
                                              stream=stream)  # type: ignore[call-overload]
    final = await runner.until_done()
    await client.close()
    assert [b.text for b in final.content if b.type == "text"] == ["Answer: 46"]
    assert session.threads  # the SDK did use server-held threads
    traj = _one_branch(session, engine)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]


async def test_refusals_are_anthropic_shaped(gateway: Gateway) -> None:
    session = gateway.open_session()
    url = f"{gateway.url}/s/{session.id}/v1/messages"
    base: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"tool_choice": {"type": "any"}}, 400, "tool_choice"),
        ({"temperature": 0.2}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0]"),
        ({"thread": {"type": "continue", "previous_message_id": "msg_nope"}}, 404, "thread"),
    ]
    async with httpx.AsyncClient(headers={"x-api-key": session.key}) as http:
        for extra, status, param in cases:
            r = await http.post(url, json={**base, **extra})
            assert r.status_code == status, (extra, r.text)
            body = r.json()
            assert body["type"] == "error" and body["error"]["param"] == param, body
        r = await http.post(url, json={**base, "thread": {"type": "continue", "previous_message_id": "msg_nope"}})
        assert r.json()["error"]["details"] == {"error_code": "thread_not_found"}  # the SDK replays on this
        r = await http.post(f"{gateway.url}/v1/messages", json=base, headers={"x-api-key": "sk-wrong"})  # key-routed
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert session.calls == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_is_reported_as_such(recorded: tuple[Gateway, RecordingEngine], stream: bool) -> None:
    """A reply cut by one of the request's `stop_sequences` says `stop_sequence` and which one (the script's
    second reply is "Answer: 42"); without them the same reply ends its turn."""
    gw, engine = recorded
    session = gw.open_session()
    client = _client(gw, session)
    messages: list[Any] = [{"role": "user", "content": "What is 7 * 6?"}]
    first = await client.messages.create(model="agentrl", max_tokens=64, system=SYSTEM, messages=messages, tools=TOOLS)
    [use] = first.content
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
    stops = ["never", "wer:"]
    if stream:
        async with client.messages.stream(model="agentrl", max_tokens=64, system=SYSTEM, messages=messages,
                                          tools=TOOLS, stop_sequences=stops) as events:
            reply = await events.get_final_message()
    else:
        reply = await client.messages.create(model="agentrl", max_tokens=64, system=SYSTEM, messages=messages,
                                             tools=TOOLS, stop_sequences=stops)
    await client.close()
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "wer:")
    assert reply.content[0].text == "Answer:"  # cut there; the text keeps the sequence, as the tokens do
    _one_branch(session, engine)
