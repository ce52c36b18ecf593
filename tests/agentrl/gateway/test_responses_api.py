"""The OpenAI Responses API (`/v1/responses`) through the gateway: the OpenAI Agents SDK with its default model
(OpenAIResponsesModel), unmodified but for its client, and the `openai` SDK's `responses` calls with
`previous_response_id` and streaming. Every trajectory holds exactly the sampled ids, in one branch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import SYSTEM, RecordingEngine, assert_token_exact, calc, make_backend

from agentrl.gateway import Gateway, GatewayConfig

pytestmark = pytest.mark.model
TOOLS: list[Any] = [{"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
                     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                    "required": ["expression"]}}]


@pytest.fixture
async def recorded(scripted: Any, chat_tokenizer: Any) -> AsyncIterator[tuple[Gateway, RecordingEngine]]:
    engine = RecordingEngine(scripted)
    async with Gateway(GatewayConfig(), make_backend(engine, chat_tokenizer)) as gw:
        yield gw, engine


def _one_branch(session: Any, engine: RecordingEngine) -> Any:
    trajs = session.trajectories(task={"id": "t"}, env="agent")
    assert len(trajs) == 1, [t.info for t in trajs]
    assert_token_exact(trajs[0], engine.sampled)
    assert [m.role for m in trajs[0].messages][-3:] == ["assistant", "tool", "assistant"]
    return trajs[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_agents_sdk_default_model(recorded: tuple[Gateway, RecordingEngine], stream: bool) -> None:
    """`Agent(model="...")` on the SDK's default client speaks the Responses API; it trains unmodified."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    gw, engine = recorded

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(calc(expression))

    session = gw.open_session()
    client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="calc", instructions=SYSTEM, tools=[calculator], model="agentrl")
    if stream:
        result: Any = Runner.run_streamed(agent, "What is 12 + 30?")
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "What is 12 + 30?")
    await client.close()
    assert result.final_output == "Answer: 42"
    traj = _one_branch(session, engine)
    assert traj.messages[0].role == "system" and traj.messages[0].content == SYSTEM


async def test_previous_response_id_and_stream_events(recorded: tuple[Gateway, RecordingEngine]) -> None:
    """`previous_response_id` continues the stored response (only the new items are sent), streamed or not."""
    gw, engine = recorded
    session = gw.open_session()
    client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
    first = await client.responses.create(model="agentrl", instructions=SYSTEM, input="What is 5 * 9?", tools=TOOLS)
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "5 * 9"}
    assert first.usage is not None and first.usage.output_tokens == len(engine.sampled[0])
    assert first.model_extra is not None and first.model_extra["token_ids"] == engine.sampled[0]
    kinds = []
    async with client.responses.stream(
        model="agentrl", instructions=SYSTEM, previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": str(calc("5 * 9"))}],
    ) as events:
        async for event in events:
            kinds.append(event.type)
        second = await events.get_final_response()
    await client.close()
    assert second.output_text == "Answer: 45"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    traj = _one_branch(session, engine)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert second.id in session.responses and first.id in session.responses


async def test_refusals(gateway: Gateway) -> None:
    session = gateway.open_session()
    url = f"{gateway.base_url(session)}/responses"
    base: dict[str, Any] = {"model": "m", "input": "hi"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"top_p": 0.5}, "top_p"),
        ({"truncation": "auto"}, "truncation"),
    ]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {session.key}"}) as http:
        for extra, param in cases:
            r = await http.post(url, json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, r.json()
        assert session.calls == 0
        unstored = (await http.post(url, json={**base, "store": False})).json()  # served, but not kept
        r = await http.post(url, json={**base, "previous_response_id": unstored["id"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert session.calls == 1 and not session.responses
