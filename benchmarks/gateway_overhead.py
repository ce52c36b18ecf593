"""Tokens/s through the OpenAI-compatible gateway vs the same engine called directly, in one run.

Workload: `--sessions` concurrent multi-turn chats (`--turns` model turns each,
`--max-tokens` per reply, temperature 1.0) on the `hf` engine
(SmolLM2-135M-Instruct by default). *Direct* runs each chat as the rollout
loop does: a token-exact `Conversation`, `engine.generate` on its prompt
ids, the reply appended verbatim, the next user message as a template delta.
*Gateway* runs the same chats as agent code would: one gateway session each,
the `openai` SDK (`AsyncOpenAI`, real HTTP on loopback) resending the whole
history every turn, the gateway matching it and keeping the trajectory. Rounds
alternate (direct, gateway, direct, ...) so a shared machine's load hits both
alike; each side's tokens/s is the sampled tokens of its rounds over their
wall time.

With `--stream` the agent side streams (`stream=True`, SSE as tokens are
sampled) and the summary adds `first_content_share`: the mean, over streamed
calls, of (time to the first content delta) / (time to the end of the answer);
near 1 means the answer came in one piece, small means it streamed.

Summary line: direct_tok_s=<x> gateway_tok_s=<y> gateway_vs_direct=<y/x> [first_content_share=<z>] (goal >= 0.9)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import openai

from agentrl.chat.conversation import Budgets, Conversation, HFChatTokenizer
from agentrl.chat.tool_parsers import HermesParser
from agentrl.engines.base import Sampling
from agentrl.engines.hf import HFEngine
from agentrl.engines.models import resolve_model
from agentrl.gateway import Backend, Gateway, GatewayConfig, TrainerSampling
from agentrl.types import Message

SYSTEM = "You are a helpful assistant. Answer in a few sentences."


def opening(i: int) -> str:
    return f"Tell me something interesting about the number {10 + i}."


async def direct(engine: HFEngine, tokenizer: HFChatTokenizer, budgets: Budgets, sessions: int, turns: int,
                 max_tokens: int) -> int:
    """The chats on the engine, as the rollout loop runs them; returns the sampled tokens."""

    async def chat(i: int) -> int:
        conv = Conversation(tokenizer, [Message("system", SYSTEM), Message("user", opening(i))], budgets=budgets)
        sampling = Sampling(max_tokens=max_tokens, temperature=1.0, stop_ids=tuple(tokenizer.eos_ids))
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


async def through_gateway(gateway: Gateway, sessions: int, turns: int, max_tokens: int,
                          shares: list[float] | None = None) -> int:
    """The same chats as agent code: the openai SDK, the whole history resent each turn (streamed with `shares`)."""

    async def chat(i: int) -> int:
        session = gateway.open_session()
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening(i)}]
        n = 0
        async with openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0) as client:
            for t in range(turns):
                if shares is None:
                    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)  # type: ignore[arg-type]
                    text, ids = r.choices[0].message.content or "", (r.choices[0].model_extra or {})["token_ids"]
                else:
                    text, ids = await streamed_call(client, messages, max_tokens, shares)
                n += len(ids)
                messages.append({"role": "assistant", "content": text})
                if t + 1 < turns:
                    messages.append({"role": "user", "content": f"Go on ({t})."})
        gateway.close_session(session)
        trajs = session.trajectories(task={}, env="bench")
        assert len(trajs) == 1 and trajs[0].num_sampled_tokens == n, "the gateway branched or lost tokens"
        return n

    return sum(await asyncio.gather(*(chat(i) for i in range(sessions))))


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(args.model)
    tokenizer = HFChatTokenizer.from_pretrained(path)
    engine = HFEngine(HFEngine.Config(model=path, dtype=args.dtype, max_batch_size=args.sessions, seed=0))
    budgets = Budgets(max_turns=args.turns, max_total_tokens=4096, max_new_tokens_per_turn=args.max_tokens)
    backend = Backend(engine=engine, tokenizer=tokenizer, parser=HermesParser(), sampling=TrainerSampling(1.0),
                      budgets=budgets)
    totals = {"direct": [0, 0.0], "gateway": [0, 0.0]}
    shares: list[float] | None = [] if args.stream else None
    try:
        async with Gateway(GatewayConfig(), backend) as gateway:
            await direct(engine, tokenizer, budgets, 2, 1, 8)  # warm-up: model, caches, HTTP stack
            await through_gateway(gateway, 2, 1, 8)
            for r in range(args.rounds):
                for side in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):
                    start = time.perf_counter()
                    if side == "direct":
                        tokens = await direct(engine, tokenizer, budgets, args.sessions, args.turns, args.max_tokens)
                    else:
                        tokens = await through_gateway(gateway, args.sessions, args.turns, args.max_tokens, shares)
                    took = time.perf_counter() - start
                    totals[side][0] += tokens
                    totals[side][1] += took
                    print(f"round {r} {side:8s} {tokens:6d} tokens {took:7.2f}s {tokens / took:8.1f} tok/s", flush=True)
    finally:
        await engine.close()  # also after a failure: the worker thread must not outlive the loop
    direct_tps = totals["direct"][0] / totals["direct"][1]
    gateway_tps = totals["gateway"][0] / totals["gateway"][1]
    summary = f"direct_tok_s={direct_tps:.1f} gateway_tok_s={gateway_tps:.1f} gateway_vs_direct={gateway_tps / direct_tps:.3f}"
    if shares:
        summary += f" first_content_share={sum(shares) / len(shares):.3f}"
    print(summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side, alternating")
    parser.add_argument("--stream", action="store_true", help="the agent side streams (SSE as tokens are sampled)")
    asyncio.run(main(parser.parse_args()))
