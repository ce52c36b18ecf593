"""Tokens/s through the gateway, per agent API, vs the same engine called directly, in one run; and the
gateway's added latency per call.

Workload: `--sessions` concurrent multi-turn chats (`--turns` model turns each,
`--max-tokens` per reply, `--temperature`, default 0) on the `hf` engine
(SmolLM2-135M-Instruct by default). *Direct* runs each chat as the rollout
loop does: a token-exact `Conversation`, `engine.generate` on its prompt
ids, the reply appended verbatim, the next user message as a template delta.
*Gateway* runs the same chats as agent code would: one gateway session each,
the `openai` SDK (`AsyncOpenAI`, real HTTP on loopback) resending the whole
history every turn, the gateway matching it and keeping the trajectory. Rounds
alternate (direct, gateway, direct, ...) so a shared machine's load hits both
alike; each side's tokens/s is the sampled tokens of its rounds over their
wall time. Greedy by default: both sides then sample the same replies, so the
ratio is the gateway's cost alone (at temperature 1 the sides' replies differ in
length and content round to round, which moves tokens/s by several percent
either way and says nothing about the gateway; docs/gateway.md).

Each API is its own side (`--api`, default all three): `chat` (Chat Completions on
the `openai` SDK), `responses` (the Responses API on the `openai` SDK, the whole
item list resent), `messages` (the Messages API on the `anthropic` SDK).

*Added latency* (`<api>_added_ms_p50`), as LiteLLM defines its proxy overhead: the
median wall time of one SDK call through the gateway (`<api>_call_ms_p50`), on a
scripted engine that answers at once with the same 32-token reply (so everything
but sampling: HTTP, matching the history, the chat-template delta, recording the
turn), minus the median of the same calls, same SDK, against a bare aiohttp
server that returns the gateway's own reply bytes (`<api>_bare_ms_p50`: the SDK's
and loopback HTTP's cost, which any server pays). Measured after the rounds over
`--latency-calls` sessions of 3 sequential calls per API.

`--constrained` adds the cost of constrained decoding per token: the direct chats
once unconstrained and once under a JSON grammar (`agentrl.engines.constrained`),
`constrained_cost` = constrained seconds per token / unconstrained seconds per token.

With `--stream` the agent side streams (`stream=True`, SSE as tokens are
sampled) and the summary adds `first_content_share`: the mean, over streamed
calls, of (time to the first content delta) / (time to the end of the answer);
near 1 means the answer came in one piece, small means it streamed.

Summary line: direct_tok_s=<x> <api>_tok_s=<y> <api>_vs_direct=<y/x> <api>_call_ms_p50=<ms> <api>_bare_ms_p50=<ms>
<api>_added_ms_p50=<call - bare> ...
gateway_vs_direct=<the lowest api's ratio> [first_content_share=<z>] [constrained_cost=<c>] (goal >= 0.9, p50 <= 5 ms)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp
import anthropic
import openai
from aiohttp import web

from agentrl.chat.conversation import Budgets, Conversation, HFChatTokenizer
from agentrl.chat.tool_parsers import HermesParser
from agentrl.engines.base import Sampling
from agentrl.engines.constrained import json_grammar
from agentrl.engines.hf import HFEngine
from agentrl.engines.models import resolve_model
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gateway import Backend, Gateway, GatewayConfig, TrainerSampling
from agentrl.types import Message

SYSTEM = "You are a helpful assistant. Answer in a few sentences."


def opening(i: int) -> str:
    return f"Tell me something interesting about the number {10 + i}."


APIS = ("chat", "responses", "messages")


async def direct(engine: HFEngine, tokenizer: HFChatTokenizer, budgets: Budgets, sessions: int, turns: int,
                 max_tokens: int, temperature: float, grammar: str | None = None) -> int:
    """The chats on the engine, as the rollout loop runs them (under `grammar` if given); returns the sampled tokens."""

    async def chat(i: int) -> int:
        conv = Conversation(tokenizer, [Message("system", SYSTEM), Message("user", opening(i))], budgets=budgets)
        sampling = Sampling(max_tokens=max_tokens, temperature=temperature, stop_ids=tuple(tokenizer.eos_ids), grammar=grammar)
        n = 0
        for t in range(turns):
            completion = await engine.generate(conv.token_ids, sampling)
            ids = completion.ids
            text = tokenizer.decode(ids[:-1] if ids and ids[-1] in tokenizer.eos_ids else ids)
            conv.add_completion(completion, Message("assistant", text))
            n += len(ids)
            if t + 1 < turns:
                conv.add_messages([Message("user", f"Go on ({t}).")])
        return n

    return sum(await asyncio.gather(*(chat(i) for i in range(sessions))))


async def streamed_call(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], max_tokens: int,
                        shares: list[float]) -> tuple[str, list[int]]:
    """One streamed call: its content and sampled ids; appends (first content delta time / answer time) to `shares`."""
    start = time.perf_counter()
    first: float | None = None
    text, ids = "", []
    stream = await client.chat.completions.create(model="m", messages=cast(Any, messages), max_tokens=max_tokens,
                                                  stream=True)
    async for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content and first is None:
            first = time.perf_counter() - start
        text += choice.delta.content or ""
        if choice.finish_reason is not None:
            ids = (choice.model_extra or {})["token_ids"]
    took = time.perf_counter() - start
    if first is not None and took > 0:
        shares.append(first / took)
    return text, ids


async def call(api: str, client: Any, messages: list[dict[str, Any]], max_tokens: int,
               shares: list[float] | None) -> tuple[str, list[int]]:
    """One agent call in `api`'s wire format with the whole history; its text and the sampled ids."""
    if api == "chat":
        if shares is not None:
            return await streamed_call(client, messages, max_tokens, shares)
        r = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
        return r.choices[0].message.content or "", (r.choices[0].model_extra or {})["token_ids"]
    if api == "responses":
        r = await client.responses.create(model="m", instructions=messages[0]["content"], input=messages[1:],
                                          max_output_tokens=max_tokens)
        return r.output_text, (r.model_extra or {})["token_ids"]
    r = await client.messages.create(model="m", system=messages[0]["content"], messages=messages[1:],
                                     max_tokens=max_tokens)
    return "".join(b.text for b in r.content if b.type == "text"), (r.model_extra or {})["token_ids"]


def client_for(api: str, gateway: Gateway, session: Any) -> Any:
    if api == "messages":
        return anthropic.AsyncAnthropic(base_url=f"{gateway.url}/s/{session.id}", api_key=session.key, max_retries=0)
    return openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)


async def through_gateway(gateway: Gateway, sessions: int, turns: int, max_tokens: int,
                          shares: list[float] | None = None, api: str = "chat") -> int:
    """The same chats as agent code: `api`'s SDK, the whole history resent each turn (streamed with `shares`)."""

    async def chat(i: int) -> int:
        session = gateway.open_session()
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(i)}]
        n = 0
        async with client_for(api, gateway, session) as client:
            for t in range(turns):
                text, ids = await call(api, client, messages, max_tokens, shares)
                n += len(ids)
                messages.append({"role": "assistant", "content": text})
                if t + 1 < turns:
                    messages.append({"role": "user", "content": f"Go on ({t})."})
        gateway.close_session(session)
        trajs = session.trajectories(task={}, env="bench")
        assert len(trajs) == 1 and trajs[0].num_sampled_tokens == n, "the gateway branched or lost tokens"
        return n

    return sum(await asyncio.gather(*(chat(i) for i in range(sessions))))


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def first_request(api: str) -> dict[str, Any]:
    """The opening call of a latency session as `api`'s wire JSON (what the SDK sends)."""
    user = {"role": "user", "content": opening(0)}
    if api == "chat":
        return {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, user], "max_tokens": 64}
    if api == "responses":
        return {"model": "m", "instructions": SYSTEM, "input": [user], "max_output_tokens": 64}
    return {"model": "m", "system": SYSTEM, "messages": [user], "max_tokens": 64}


async def call_times(api: str, client_at: Callable[[], AbstractAsyncContextManager[Any]], calls: int) -> list[float]:
    """Seconds per SDK call, `calls` sessions of 3 calls each (the history resent every call) after 3 warm-up ones."""
    took: list[float] = []
    for k in range(-3, calls):
        async with client_at() as client:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(k)}]
            for t in range(3):
                start = time.perf_counter()
                text, _ = await call(api, client, messages, 64, None)
                if k >= 0:
                    took.append(time.perf_counter() - start)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({t})."}]
    return took


async def bare_times(api: str, body: bytes, calls: int) -> list[float]:
    """The same SDK calls against a bare aiohttp server that reads each request and returns `body` (a reply
    the gateway gave): the SDK's and HTTP's own cost, the baseline the gateway's added latency is measured from."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post(PATHS[api], answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = cast(Any, site._server).sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        def client_at() -> Any:
            if api == "messages":
                return anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
            return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)

        return await call_times(api, client_at, calls)
    finally:
        await runner.cleanup()


async def added_latency(tokenizer: HFChatTokenizer, api: str, calls: int) -> tuple[float, float]:
    """Median ms of one SDK call through the gateway on an engine that answers at once (all but sampling),
    and of the same call against a bare server returning the gateway's own reply bytes (same SDK, same HTTP)."""
    reply = " ".join(["word"] * 31)
    engine = ScriptedEngine(ScriptedEngine.Config(replies=[reply]), tokenizer=tokenizer)
    backend = Backend(engine=engine, tokenizer=tokenizer, parser=HermesParser(), sampling=TrainerSampling(1.0),
                      budgets=Budgets(max_turns=10**6, max_total_tokens=10**7, max_new_tokens_per_turn=64))
    async with Gateway(GatewayConfig(), backend) as gateway:

        @asynccontextmanager
        async def client_at() -> AsyncIterator[Any]:
            session = gateway.open_session()
            try:
                async with client_for(api, gateway, session) as client:
                    yield client
            finally:
                gateway.close_session(session)

        session = gateway.open_session()
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {session.key}", "x-api-key": session.key,
                       "anthropic-version": "2023-06-01"}
            async with http.post(f"{gateway.url}/s/{session.id}{PATHS[api]}", json=first_request(api),
                                 headers=headers) as r:
                r.raise_for_status()
                body = await r.read()
        gateway.close_session(session)
        through = await call_times(api, client_at, calls)
    bare = await bare_times(api, body, calls)
    return 1000 * statistics.median(through), 1000 * statistics.median(bare)


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(args.model)
    tokenizer = HFChatTokenizer.from_pretrained(path)
    engine = HFEngine(HFEngine.Config(model=path, dtype=args.dtype, max_batch_size=args.sessions, seed=0))
    budgets = Budgets(max_turns=args.turns, max_total_tokens=4096, max_new_tokens_per_turn=args.max_tokens)
    backend = Backend(engine=engine, tokenizer=tokenizer, parser=HermesParser(), sampling=TrainerSampling(args.temperature),
                      budgets=budgets)
    apis = APIS if args.api == "all" else (args.api,)
    sides = ["direct", *apis]
    totals = {side: [0, 0.0] for side in sides}
    shares: list[float] | None = [] if args.stream else None
    constrained = [0, 0.0]
    try:
        async with Gateway(GatewayConfig(), backend) as gateway:
            await direct(engine, tokenizer, budgets, 2, 1, 8, args.temperature)  # warm-up: model, caches, HTTP stack
            for api in apis:
                await through_gateway(gateway, 2, 1, 8, api=api)
            for r in range(args.rounds):
                for side in sides[r % len(sides):] + sides[: r % len(sides)]:  # rotated: load hits every side alike
                    start = time.perf_counter()
                    if side == "direct":
                        tokens = await direct(engine, tokenizer, budgets, args.sessions, args.turns, args.max_tokens,
                                              args.temperature)
                    else:
                        streamed = shares if side == "chat" else None
                        tokens = await through_gateway(gateway, args.sessions, args.turns, args.max_tokens, streamed, side)
                    took = time.perf_counter() - start
                    totals[side][0] += tokens
                    totals[side][1] += took
                    print(f"round {r} {side:9s} {tokens:6d} tokens {took:7.2f}s {tokens / took:8.1f} tok/s", flush=True)
                if args.constrained:
                    start = time.perf_counter()
                    tokens = await direct(engine, tokenizer, budgets, args.sessions, args.turns, args.max_tokens,
                                          args.temperature, grammar=json_grammar())
                    took = time.perf_counter() - start
                    constrained[0] += tokens
                    constrained[1] += took
                    print(f"round {r} {'json':9s} {tokens:6d} tokens {took:7.2f}s {tokens / took:8.1f} tok/s", flush=True)
    finally:
        await engine.close()  # also after a failure: the worker thread must not outlive the loop
    latency = {api: await added_latency(tokenizer, api, args.latency_calls) for api in apis}
    direct_tps = totals["direct"][0] / totals["direct"][1]
    parts = [f"direct_tok_s={direct_tps:.1f}"]
    ratios = []
    for api in apis:
        tps = totals[api][0] / totals[api][1]
        ratios.append(tps / direct_tps)
        call_ms, bare_ms = latency[api]
        parts += [f"{api}_tok_s={tps:.1f}", f"{api}_vs_direct={tps / direct_tps:.3f}", f"{api}_call_ms_p50={call_ms:.2f}",
                  f"{api}_bare_ms_p50={bare_ms:.2f}", f"{api}_added_ms_p50={call_ms - bare_ms:.2f}"]
    parts.append(f"gateway_vs_direct={min(ratios):.3f}")
    if shares:
        parts.append(f"first_content_share={sum(shares) / len(shares):.3f}")
    if args.constrained and constrained[0]:
        per_token = constrained[1] / constrained[0]
        parts.append(f"constrained_cost={per_token / (totals['direct'][1] / totals['direct'][0]):.3f}")
    print(" ".join(parts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, the same replies on every side (the default); 1: the training distribution")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side, alternating")
    parser.add_argument("--stream", action="store_true", help="the chat side streams (SSE as tokens are sampled)")
    parser.add_argument("--api", default="all", choices=["all", *APIS], help="which agent APIs to measure")
    parser.add_argument("--latency-calls", type=int, default=30, help="sessions (3 calls each) per API for added latency")
    parser.add_argument("--constrained", action="store_true", help="also time the direct chats under a JSON grammar")
    asyncio.run(main(parser.parse_args()))
