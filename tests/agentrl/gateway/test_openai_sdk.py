"""The real `openai` SDK (sync and async, streamed and not) runs a multi-turn tool-calling agent through the
gateway; each session's trajectory holds exactly the sampled ids."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from gateway_helpers import SYSTEM, TOOLS, assert_token_exact, calc, openai_agent

from agentrl.gateway import Gateway


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
async def test_async_client_tool_loop_is_token_exact(gateway: Gateway, stream: bool) -> None:
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    answer, sampled = await openai_agent(client, "What is 12 + 34?", stream=stream)
    await client.close()
    assert answer == "Answer: 46"
    assert len(sampled) == 2  # the tool call, then the answer
    gateway.close_session(session)
    [traj] = session.trajectories(task={"id": "t"}, env="agent", reward=1.0)
    assert_token_exact(traj, sampled)
    assert traj.info["gateway"]["branches"] == 1 and "branch" not in traj.info
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = traj.messages[2].tool_calls[0]
    assert call.name == "calculator" and call.arguments == {"expression": "12 + 34"}
    assert traj.messages[3].tool_call_id == call.id and call.id.startswith("call_")
    assert traj.prompt_messages == 2 and traj.reward == 1.0 and traj.terminated


def _sync_agent(base_url: str, key: str, stream: bool) -> tuple[str, list[list[int]]]:
    """The same loop on the synchronous `openai.OpenAI` client."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 7 * 6?"}]
    sampled: list[list[int]] = []
    for _ in range(4):
        if stream:
            content, calls, ids = "", {}, []
            for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,  # type: ignore[call-overload]
                                                        stream_options={"include_usage": True}):
                if not chunk.choices:
                    assert chunk.usage is not None and chunk.usage.completion_tokens == len(ids)
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for d in delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": "", "arguments": ""}})
                    c["function"]["name"] += (d.function.name or "") if d.function else ""
                    c["function"]["arguments"] += (d.function.arguments or "") if d.function else ""
                if chunk.choices[0].finish_reason:
                    ids = chunk.choices[0].model_extra["token_ids"]
            tool_calls = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[call-overload]
            content = r.choices[0].message.content or ""
            tool_calls = [c.model_dump() for c in r.choices[0].message.tool_calls or []]
            ids = r.choices[0].model_extra["token_ids"]
        sampled.append(ids)
        messages.append({"role": "assistant", "content": content or None, **({"tool_calls": tool_calls} if tool_calls else {})})
        if not tool_calls:
            client.close()
            return content, sampled
        for c in tool_calls:
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": str(calc(json.loads(c["function"]["arguments"])["expression"]))})
    client.close()
    return "", sampled


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
async def test_sync_client_tool_loop_is_token_exact(gateway: Gateway, stream: bool) -> None:
    session = gateway.open_session()
    answer, sampled = await asyncio.to_thread(_sync_agent, gateway.base_url(session), session.key, stream)
    assert answer == "Answer: 42"
    [traj] = session.trajectories(task={"id": "t"}, env="agent")
    assert_token_exact(traj, sampled)


@pytest.mark.model
async def test_logprobs_ids_and_versions_are_the_engines(gateway: Gateway) -> None:
    """Logprobs, ids and policy versions in the response are what the trajectory records."""
    gateway.backend.engine.set_version(3)  # type: ignore[attr-defined]
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key, max_retries=0)  # key-routed
    r = await client.chat.completions.create(
        model="agentrl", messages=[{"role": "user", "content": "What is 2 + 2?"}], logprobs=True,
        extra_body={"return_token_ids": True},
    )
    await client.close()
    choice = r.choices[0]
    [traj] = session.trajectories(task={}, env="agent")
    turn = traj.turns[0]
    assert traj.token_ids[turn.start : turn.end] == choice.model_extra["token_ids"]
    assert choice.logprobs is not None
    assert [t.logprob for t in choice.logprobs.content] == traj.logprobs[turn.start : turn.end] == [-0.5] * (turn.end - turn.start)
    assert choice.model_extra["policy_versions"] == traj.versions[turn.start : turn.end] == [3] * (turn.end - turn.start)
    assert r.model_extra["prompt_token_ids"] == traj.token_ids[: turn.start]
    assert r.usage is not None and r.usage.prompt_tokens == turn.start and r.usage.completion_tokens == turn.end - turn.start
    assert choice.finish_reason == "tool_calls"


@pytest.mark.model
async def test_models_and_token_id_completions(gateway: Gateway, chat_tokenizer: Any) -> None:
    """GET /v1/models; /v1/completions takes token ids, and a prompt that extends the last one continues its branch."""
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["agentrl"]
    prompt = chat_tokenizer.encode("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    first = await client.completions.create(model="agentrl", prompt=prompt, max_tokens=64)
    ids1 = first.choices[0].model_extra["token_ids"]
    assert "calculator" in first.choices[0].text
    more = chat_tokenizer.encode("<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    second = await client.completions.create(model="agentrl", prompt=[*prompt, *ids1, *more], max_tokens=64)
    ids2 = second.choices[0].model_extra["token_ids"]
    assert second.choices[0].text == "Answer: 7"
    await client.close()
    [traj] = session.trajectories(task={}, env="agent")
    assert traj.info["gateway"]["kind"] == "tokens"
    assert traj.token_ids == [*prompt, *ids1, *more, *ids2]
    assert traj.loss_mask == [0] * len(prompt) + [1] * len(ids1) + [0] * len(more) + [1] * len(ids2)
