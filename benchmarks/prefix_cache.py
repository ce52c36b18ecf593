"""Multi-turn rollouts on the hf engine with prefix caching on vs off, in one run.

The shape of the default example (examples/calculator.yaml): SmolLM2-135M-Instruct,
episodes that share a ~430-token prefix (system prompt with a calculator tool and
two few-shot demonstrations), each with its own question, 3 turns where turn t+1's
prompt is turn t's prompt + completion + a tool result. All episodes run
concurrently on one engine (max_batch_size = episodes); the same seeds and the
same weights serve both settings (one model object, two engines in turn).

Summary line: prefix_cache_speedup=<wall off / wall on> hit_rate=<cached prompt
tokens / all prompt tokens, cache on> ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from agentrl.engines.base import Sampling
from agentrl.engines.hf import HFEngine

SYSTEM = (
    "You are a careful assistant that solves arithmetic word problems. You cannot do arithmetic in your head: "
    "you must use the calculator tool for every computation, then give the final answer on its own line as "
    "'Answer: N'. To call the tool, reply with exactly one tool call in this format and nothing else:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "<expression>"}}\n</tool_call>\n'
    "The tool replies with the value of the expression. Expressions may use +, -, * and parentheses. "
    "Never guess a result; if the tool reports an error, fix the expression and call it again. Keep replies short.\n"
    "Tools:\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression '
    'with integers, +, -, * and parentheses, and return its value.", "parameters": {"type": "object", '
    '"properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}}, '
    '"required": ["expression"]}}}'
)
DEMOS = [
    ("Tom has 23 apples and buys 19 more. How many apples does he have?", "23 + 19", "42"),
    ("A box holds 12 pencils. How many pencils are in 7 boxes?", "12 * 7", "84"),
]


def call(expr: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def first_prompt(tok: Any, i: int) -> list[int]:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for question, expr, value in DEMOS:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": call(expr)},
            {"role": "user", "content": f"<tool_response>\n{value}\n</tool_response>"},
            {"role": "assistant", "content": f"Answer: {value}"},
        ]
    a, b = 11 + 7 * i % 80, 3 + 13 * i % 60
    messages.append({"role": "user", "content": f"A shop sells {a} pens on Monday and {b} on Tuesday. How many pens?"})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text))


def tool_delta(tok: Any, turn: int) -> list[int]:
    """What the chat template adds after an assistant turn: a tool result and the next generation prompt."""
    return list(tok.encode(f"\n<|im_start|>user\n<tool_response>\n{17 * turn + 5}\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n"))


async def episode(engine: HFEngine, tok: Any, i: int, turns: int, max_new: int) -> list[list[int]]:
    prompt = first_prompt(tok, i)
    replies = []
    for t in range(turns):
        out = await engine.generate(prompt, Sampling(max_tokens=max_new, temperature=1.0, seed=1000 * i + t))
        replies.append(out.ids)
        prompt = prompt + out.ids + tool_delta(tok, t)
    return replies


async def run(engine: HFEngine, tok: Any, episodes: int, turns: int, max_new: int) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outs = await asyncio.gather(*[episode(engine, tok, i, turns, max_new) for i in range(episodes)])
    return time.perf_counter() - start, outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    # fp32 by default: on the shared 2-core reference machine bf16 prefill ran ~2.5x slower than fp32
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)

    def engine(cap: int, model: Any = None, tok: Any = None) -> HFEngine:
        cfg = HFEngine.Config(model=args.model, dtype=args.dtype, max_batch_size=args.episodes,
                              prefix_cache_tokens=cap)
        return HFEngine(cfg, model=model, tokenizer=tok)

    off = engine(0)
    model, tok = off.model, off.tokenizer
    on = engine(32768, model, tok)
    shared = len(first_prompt(tok, 0))
    print(f"first prompt: {shared} tokens; {args.episodes} episodes x {args.turns} turns, "
          f"<= {args.max_new_tokens} new tokens per turn, dtype {args.dtype}")
    for eng in (off, on):  # warm up (first-call allocations), then forget the warm-up's entries
        asyncio.run(run(eng, tok, 2, 1, 4))
        eng._prefix.clear()

    results = {}
    for name, eng in (("off", off), ("on", on)):
        before = asyncio.run(eng.health()).detail
        wall, outs = asyncio.run(run(eng, tok, args.episodes, args.turns, args.max_new_tokens))
        after = asyncio.run(eng.health()).detail
        prefill = after["prefill_tokens"] - before["prefill_tokens"]
        hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        tokens = sum(len(r) for ep in outs for r in ep)
        results[name] = (wall, outs, prefill, hit)
        print(f"cache {name:3s}: {wall:6.1f}s  {tokens} sampled tokens  prefilled {prefill} prompt tokens, "
              f"{hit} from the cache, {tokens / wall:.1f} sampled tok/s")
    wall_off, outs_off, prefill_off, _ = results["off"]
    wall_on, outs_on, prefill_on, hit_on = results["on"]
    identical = sum(a == b for a, b in zip(outs_off, outs_on, strict=True))
    detail = asyncio.run(on.health()).detail
    print(f"cache on at the end: {detail['prefix_cache_entries']} entries, {detail['prefix_cache_tokens']} tokens, "
          f"{detail['prefix_cache_evictions']} evictions; episodes with identical samples on/off: "
          f"{identical}/{args.episodes} (bf16 rounding may differ)")
    asyncio.run(off.close())
    asyncio.run(on.close())
    print(f"load={os.getloadavg()[0]:.2f}")
    print(f"prefix_cache_speedup={wall_off / wall_on:.2f} hit_rate={hit_on / (hit_on + prefill_on):.3f} "
          f"prefill_tokens_off={prefill_off} prefill_tokens_on={prefill_on} wall_off_s={wall_off:.1f} "
          f"wall_on_s={wall_on:.1f}")


if __name__ == "__main__":
    main()
