"""Tokens/s of the hf engine for 32 concurrent requests vs plain batched `model.generate`
and vs transformers' own continuous batching (`model.generate_batch`).

Same model (SmolLM2-135M-Instruct), same dtype, same 32 chat prompts, same
max new tokens and sampling (temperature 1.0), in one run. Tokens counted are
the sampled tokens up to and including eos (padding after eos is not counted).
`generate_batch` gets a paged KV cache sized to this workload
(`ContinuousBatchingConfig(num_blocks=..., max_batch_tokens=...)`): left to
size itself it claimed ~7 GiB more on the 2-core/24 GiB reference machine and
was killed. `--no-generate-batch` skips it. The default dtype is fp32: on that
CPU bf16 generation was ~2.8x slower (30 vs 83 tok/s for the engine).

Summary line: engine_vs_generate=<engine tok/s / generate tok/s>
engine_vs_generate_batch=<engine tok/s / generate_batch tok/s> ...
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


def run_generate_batch(model: object, batch: list[list[int]], eos: int, max_new: int) -> float:
    """transformers' continuous batching on the same prompts; its paged cache sized to them. Returns tok/s."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    page = 256
    pages_per_request = -(-(max(len(p) for p in batch) + max_new) // page)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=2 * len(batch) * pages_per_request,
                                  max_batch_tokens=sum(len(p) for p in batch) + len(batch))
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=eos, pad_token_id=eos)
    warm = GenerationConfig(max_new_tokens=4, do_sample=True, eos_token_id=eos, pad_token_id=eos)
    # not under inference_mode: generate_batch's worker thread updates tensors made here in place
    model.generate_batch(inputs=batch[:2], generation_config=warm,  # type: ignore[attr-defined]
                         continuous_batching_config=cb, progress_bar=False)
    start = time.perf_counter()
    res = model.generate_batch(inputs=batch, generation_config=cfg,  # type: ignore[attr-defined]
                               continuous_batching_config=cb, progress_bar=False)
    gb_s = time.perf_counter() - start
    gb_tokens = sum(len(r.generated_tokens) for r in res.values())
    print(f"generate_batch: {gb_tokens} tokens in {gb_s:.1f}s = {gb_tokens / gb_s:.1f} tok/s")
    return gb_tokens / gb_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-generate-batch", action="store_true", help="skip transformers' generate_batch")
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
    if not args.no_generate_batch:
        gb_tps = run_generate_batch(model, batch, eos, args.max_new_tokens)
        summary += f" engine_vs_generate_batch={eng_tps / gb_tps:.2f} generate_batch_tok_s={gb_tps:.1f}"
    asyncio.run(engine.close())
    print(f"load={os.getloadavg()[0]:.2f}")
    print(summary)


if __name__ == "__main__":
    main()
