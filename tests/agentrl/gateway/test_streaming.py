"""True token streaming: SSE content deltas leave the gateway while the engine is still sampling, and a streamed
call records exactly the trajectory a non-streamed one does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest
from gateway_helpers import TOOLS, assert_token_exact, make_backend

from agentrl.chat.conversation import Budgets, HFChatTokenizer
from agentrl.engines.base import Sampling, TokenDelta, generate_stream, join_deltas
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gateway import Gateway, GatewayConfig
from agentrl.gateway.streaming import STREAM_MARKERS, ContentStream
from agentrl.types import Completion

pytestmark = pytest.mark.model

REPLY = "The answer is forty two, said the model."
CALL = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.mark.parametrize("text", ["Price: 12€, naïve café — 東京タワー 🚀 ok", "  spaced  out  ", CALL, "a <tool_c"])
def test_content_stream_adds_up_to_the_parsed_content(chat_tokenizer: HFChatTokenizer, text: str) -> None:
    """Fed one token at a time (multi-byte characters split across tokens), the deltas add up to the
    non-streamed content; the text of a tool call, and a tail that may begin one, never go out early."""
    from agentrl.chat.tool_parsers import HermesParser

    ids = [*chat_tokenizer.encode(text), chat_tokenizer.eos_ids[0]]
    stream = ContentStream(chat_tokenizer.decode, chat_tokenizer.eos_ids, STREAM_MARKERS["hermes"], strip=True)
    pieces = [stream.feed(ids[: i + 1]) for i in range(len(ids))]
    parsed = HermesParser().parse(text)
    expected = parsed.content if parsed.tool_calls else text.strip()
    if text == "a <tool_c":  # the tail could still become a call: it waits for the end
        assert "".join(pieces) == "a" and parsed.content == "a <tool_c"
    else:
        assert "".join(pieces) == expected and len([p for p in pieces if p]) > 1
    assert all("\ufffd" not in p and "<tool" not in p for p in pieces)


class GatedEngine:
    """A scripted engine whose stream stops after `after` tokens until the test opens `gate`."""

    def __init__(self, inner: ScriptedEngine, after: int) -> None:
        self.inner = inner
        self.after = after
        self.gate = asyncio.Event()
        self.held = asyncio.Event()  # set while the stream waits at the gate
        self.policy_version = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        return await self.inner.generate(prompt_ids, sampling)

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]:
        n = 0
        async for delta in self.inner.generate_stream(prompt_ids, sampling):
            if n == self.after:
                self.held.set()
                await asyncio.wait_for(self.gate.wait(), 30)
                self.held.clear()
            n += len(delta.ids)
            yield delta

    async def update_weights(self, weights: Any, version: int) -> None: ...

    async def health(self) -> Any:
        return await self.inner.health()

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
async def gated(chat_tokenizer: HFChatTokenizer) -> AsyncIterator[tuple[Gateway, GatedEngine]]:
    engine = GatedEngine(ScriptedEngine(ScriptedEngine.Config(replies=[REPLY, CALL]), tokenizer=chat_tokenizer), after=4)
    async with Gateway(GatewayConfig(), make_backend(engine, chat_tokenizer)) as gw:
        yield gw, engine


async def test_content_chunks_arrive_while_the_engine_is_still_sampling(
    gated: tuple[Gateway, GatedEngine], chat_tokenizer: HFChatTokenizer
) -> None:
    gateway, engine = gated
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
    first_four = chat_tokenizer.decode(chat_tokenizer.encode(REPLY)[:4]).strip()
    early: list[str] = []
    pieces: list[str] = []
    ids: list[int] = []
    stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    async for chunk in stream:
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        if not engine.gate.is_set() and "".join(pieces) == first_four:  # the engine cannot go on before this
            await asyncio.wait_for(engine.held.wait(), 30)
            assert session.calls == 0  # the call has not finished: its 5th token waits at the gate
            early = [p for p in pieces if p]
            engine.gate.set()
        if choice.finish_reason is not None:
            ids = (choice.model_extra or {})["token_ids"]
            assert choice.finish_reason == "stop"
    assert len(early) > 1, early  # more than one content chunk before the completion ended
    assert "".join(pieces) == REPLY
    messages.append({"role": "assistant", "content": "".join(pieces)})
    messages.append({"role": "user", "content": "And again?"})

    # a tool call: the text before it streams, the call comes parsed at the end, the markup never as content
    engine.gate = asyncio.Event()
    content, calls, call_ids = "", [], []
    stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    async for chunk in stream:
        if engine.held.is_set() and not engine.gate.is_set():
            engine.gate.set()
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        calls += choice.delta.tool_calls or []
        if choice.finish_reason is not None:
            call_ids = (choice.model_extra or {})["token_ids"]
            assert choice.finish_reason == "tool_calls"
    await client.close()
    assert content == "Let me compute." and "<tool_call" not in content
    assert calls[0].function.name == "calculator"  # type: ignore[union-attr]
    assert json.loads(calls[1].function.arguments) == {"expression": "6 * 7"}  # type: ignore[union-attr]
    gateway.close_session(session)
    [traj] = session.trajectories(task={}, env="agent")
    assert_token_exact(traj, [ids, call_ids])


@pytest.mark.slow
async def test_hf_engine_streams_the_tokens_it_would_generate(tiny_llama_path: str) -> None:
    """The hf engine's stream: one delta per sampled token, joined exactly `generate`'s completion (same seed),
    and a streamed gateway call records the same trajectory as a non-streamed one."""
    from agentrl.engines.hf import HFEngine

    tokenizer = HFChatTokenizer.from_pretrained(tiny_llama_path)
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", seed=1, prefix_cache_tokens=0,
                                      stop_on_eos=False))
    try:
        prompt = tokenizer.encode("Count with me: one, two, three")
        sampling = Sampling(max_tokens=20, temperature=1.0, seed=7)
        deltas = [d async for d in generate_stream(engine, prompt, sampling)]
        whole = await engine.generate(prompt, sampling)
        assert join_deltas(deltas) == whole and len(whole.ids) == 20
        assert [len(d.ids) for d in deltas[:-1]] == [1] * (len(deltas) - 1) and len(deltas) >= 20
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]

        budgets = Budgets(max_turns=4, max_total_tokens=1024, max_new_tokens_per_turn=16)
        async with Gateway(GatewayConfig(), make_backend(engine, tokenizer, budgets=budgets)) as gateway:
            trajectories = []
            for stream in (False, True):
                session = gateway.open_session()
                async with openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key,
                                              max_retries=0) as client:
                    messages = [{"role": "user", "content": "Say something."}]
                    if stream:
                        text, ids, chunks = "", [], 0
                        async for chunk in await client.chat.completions.create(
                            model="m", messages=messages, stream=True, seed=3, tool_choice="none"  # type: ignore[arg-type]
                        ):
                            piece = chunk.choices[0].delta.content
                            chunks += bool(piece)
                            text += piece or ""
                            if chunk.choices[0].finish_reason:
                                ids = (chunk.choices[0].model_extra or {})["token_ids"]
                        assert chunks > 1
                    else:
                        r = await client.chat.completions.create(model="m", messages=messages, seed=3,  # type: ignore[arg-type]
                                                                 tool_choice="none")
                        text, ids = r.choices[0].message.content or "", r.choices[0].model_extra["token_ids"]  # type: ignore[index]
                gateway.close_session(session)
                [traj] = session.trajectories(task={}, env="agent")
                assert_token_exact(traj, [ids])
                trajectories.append((traj, text))
        (plain, plain_text), (streamed, streamed_text) = trajectories
        assert streamed_text == plain_text  # with tool_choice none the content is the decoded reply, as sampled
        assert (streamed.token_ids, streamed.loss_mask, streamed.logprobs, streamed.versions) == (
            plain.token_ids, plain.loss_mask, plain.logprobs, plain.versions)
    finally:
        await engine.close()


@pytest.mark.slow
async def test_leaving_an_hf_stream_early_drops_its_request(tiny_llama_path: str) -> None:
    from agentrl.engines.hf import HFEngine

    tokenizer = HFChatTokenizer.from_pretrained(tiny_llama_path)
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", stop_on_eos=False))
    try:
        stream = engine.generate_stream(tokenizer.encode("Go on forever."), Sampling(max_tokens=1500, seed=1))
        first = [await anext(stream), await anext(stream)]
        assert [len(d.ids) for d in first] == [1, 1] and first[1].finish_reason is None
        await stream.aclose()
        async with asyncio.timeout(60):
            while (await engine.health()).in_flight:
                await asyncio.sleep(0.01)
        assert engine.tokens_generated < 1500  # the worker dropped the row instead of decoding it to the end
        done = await engine.generate(tokenizer.encode("Hi"), Sampling(max_tokens=3, seed=2))
        assert len(done.ids) == 3  # the engine serves on
    finally:
        await engine.close()
