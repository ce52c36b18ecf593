"""Token-exactness through the gateway with the real `hf` engine (a tiny random Llama, SmolLM2's tokenizer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from gateway_helpers import assert_token_exact, make_backend

from agentrl.chat.conversation import Budgets, HFChatTokenizer
from agentrl.gateway import Gateway, GatewayConfig

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture
async def hf_gateway(tiny_llama_path: str) -> AsyncIterator[Gateway]:
    from agentrl.engines.hf import HFEngine

    tokenizer = HFChatTokenizer.from_pretrained(tiny_llama_path)
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", max_batch_size=8, seed=1))
    budgets = Budgets(max_turns=8, max_total_tokens=2048, max_new_tokens_per_turn=24)
    async with Gateway(GatewayConfig(), make_backend(engine, tokenizer, budgets=budgets)) as gw:
        yield gw
    await engine.close()


async def _chat(client: Any, turns: int, opening: str, *, stream: bool) -> list[list[int]]:
    """A multi-turn agent that keeps the model's replies verbatim in its history."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": opening}]
    sampled = []
    for t in range(turns):
        if stream:
            text, ids = "", []
            async for chunk in await client.chat.completions.create(model="m", messages=messages, stream=True, max_tokens=16):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    if chunk.choices[0].finish_reason:
                        ids = chunk.choices[0].model_extra["token_ids"]
        else:
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=16, logprobs=True)
            text, ids = r.choices[0].message.content or "", r.choices[0].model_extra["token_ids"]
        sampled.append(ids)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({t})."}]
    return sampled


@pytest.mark.parametrize("stream", [False, True])
async def test_hf_engine_trajectories_hold_exactly_the_sampled_ids(hf_gateway: Gateway, stream: bool) -> None:
    sessions = [hf_gateway.open_session() for _ in range(3)]

    async def run(i: int) -> list[list[int]]:
        s = sessions[i]
        async with openai.AsyncOpenAI(base_url=hf_gateway.base_url(s), api_key=s.key, max_retries=0) as client:
            return await _chat(client, 3, f"Tell me about the number {i}.", stream=stream)

    results = await asyncio.gather(*(run(i) for i in range(3)))
    for session, sampled in zip(sessions, results, strict=True):
        trajs = session.trajectories(task={}, env="agent")
        assert len(trajs) == 1, [t.info for t in trajs]  # every call extended the one conversation
        traj = trajs[0]
        assert_token_exact(traj, sampled)
        assert all(1 <= len(ids) <= 16 for ids in sampled)
        sampled_lps = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
        assert all(lp <= 0.0 for lp in sampled_lps) and any(lp < 0.0 for lp in sampled_lps)
        assert set(v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m) == {0}
