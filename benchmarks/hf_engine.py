"""Tokens/s of the hf engine for 32 concurrent requests vs plain batched `model.generate`.

Same model (SmolLM2-135M-Instruct), same dtype, same 32 chat prompts, same
max new tokens and sampling (temperature 1.0), in one run. Tokens counted are
the sampled tokens up to and including eos (padding after eos is not counted).
`--with-generate-batch` also times transformers' own continuous batching
(`model.generate_batch`) on the same prompts. On the 2-core/24 GiB reference
machine that step was killed twice without a traceback (memory jumped by
~7 GiB first: probably the OOM killer), so it is off by default.

Summary line: engine_vs_generate=<engine tok/s / generate tok/s> ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from agentrl.engines.base import Sampling
from agentrl.engines.hf import HFEngine

QUESTIONS = [
    "What is {a} + {b}?",
    "Name a fruit that starts with the letter {c}.",
    "Write one sentence about the number {a}.",
    "Is {a} larger than {b}? Answer briefly.",
]


def prompts(tokenizer: object, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=10 + i, b=7 * i % 50, c="ABCDEFGH"[i % 8])
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text))  # type: ignore[attr-defined]
    return out


def count_tokens(rows: torch.Tensor, eos: int) -> int:
    total = 0
    for row in rows.tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


async def run_engine(engine: HFEngine, batch: list[list[int]], max_new: int) -> tuple[int, float]:
    start = time.perf_counter()
    comps = await asyncio.gather(*[engine.generate(p, Sampling(max_tokens=max_new, seed=i)) for i, p in enumerate(batch)])
    return sum(len(c.ids) for c in comps), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--with-generate-batch", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)

    engine = HFEngine(HFEngine.Config(model=args.model, dtype=args.dtype, max_batch_size=args.requests))
    model, tok = engine.model, engine.tokenizer
    batch = prompts(tok, args.requests)
    eos = int(model.generation_config.eos_token_id)

    # warm up both paths once (first-call allocations)
    asyncio.run(run_engine(engine, batch[:2], 4))
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": batch}, return_tensors="pt")
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, do_sample=True, pad_token_id=eos)

    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, pad_token_id=eos)
        gen_s = time.perf_counter() - start
    gen_tokens = count_tokens(out[:, enc["input_ids"].shape[1]:], eos)
    gen_tps = gen_tokens / gen_s
    print(f"model.generate: {gen_tokens} tokens in {gen_s:.1f}s = {gen_tps:.1f} tok/s")

    eng_tokens, eng_s = asyncio.run(run_engine(engine, batch, args.max_new_tokens))
    eng_tps = eng_tokens / eng_s
    print(f"hf engine:      {eng_tokens} tokens in {eng_s:.1f}s = {eng_tps:.1f} tok/s")

    summary = f"engine_vs_generate={eng_tps / gen_tps:.2f} engine_tok_s={eng_tps:.1f} generate_tok_s={gen_tps:.1f}"
    if args.with_generate_batch:
        from transformers import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, eos_token_id=eos, pad_token_id=eos)
        start = time.perf_counter()
        res = model.generate_batch(inputs=batch, generation_config=cfg)
        gb_s = time.perf_counter() - start
        gb_tokens = sum(len(r.generated_tokens) for r in res.values())
        gb_tps = gb_tokens / gb_s
        print(f"generate_batch: {gb_tokens} tokens in {gb_s:.1f}s = {gb_tps:.1f} tok/s")
        summary += f" generate_batch_tok_s={gb_tps:.1f}"
    asyncio.run(engine.close())
    print(f"load={os.getloadavg()[0]:.2f}")
    print(summary)


if __name__ == "__main__":
    main()
