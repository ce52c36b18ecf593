"""Prefix routing vs least-loaded routing over two engine replicas on Ray, for multi-turn conversations.

`--replicas` (2) `hf` replicas of SmolLM2-135M-Instruct (fp32, one CPU thread each) serve
the same multi-turn workload twice in one run, once per routing mode, each on
a fresh pool (empty prefix caches): `--conversations` chat prompts, each
continued for `--turns` turns (the prompt of a turn is the previous prompt,
the completion and a fixed ~150-token tool output, as a rollout resends its
conversation),
all conversations running concurrently with replies of different lengths
(up to `--max-new-tokens`), so they fall out of step as real episodes do. Counted from the replicas' own
health reports: prompt tokens prefilled vs taken from the prefix cache, and
the wall time of the workload (pool start excluded).

Between turns the tool "runs" for 0 to 2x `--tool-latency-s` (0.5 s), as
env steps do. Without that pause least-loaded routing keeps conversations in
place by itself: the replica a turn just left is the least loaded one when the
next turn arrives at once. With it, other requests come in between, and
least-loaded routing lands a turn on the replica holding its conversation only
about 1/replicas of the time, so the gap grows with the number of replicas.

Summary line: prefill_ratio=<least_loaded prefilled tokens / prefix prefilled tokens>
speedup=<least_loaded wall / prefix wall> prefix_hit_share=... least_loaded_hit_share=...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# a tool's output, as agentic envs return them (~150 tokens): what a replica must prefill on a cache miss
REPLY = "Tool result: " + ", ".join(f"row {i}: value={i * 37 % 101}" for i in range(20)) + ". Continue."


async def workload(pool: Any, tok: Any, conversations: int, turns: int, max_new: int, tool_s: float) -> float:
    from hf_engine import prompts

    from agentrl.engines.base import Sampling

    reply = tok.encode(tok.apply_chat_template([{"role": "user", "content": REPLY}], tokenize=False,
                                               add_generation_prompt=True))  # fmt: skip

    async def converse(i: int, prompt: list[int]) -> None:
        for turn in range(turns):
            # replies of different lengths: conversations fall out of step, as real episodes do
            length = max_new // 3 + (7 * i + 5 * turn) % max_new
            out = await pool.generate(prompt, Sampling(max_tokens=length, seed=1000 * i + turn))
            prompt = prompt + out.ids + reply
            await asyncio.sleep(tool_s * ((7 * i + 3 * turn) % 10) / 5)  # the tool runs: 0 to 2x tool_s

    start = time.perf_counter()
    await asyncio.gather(*(converse(i, p) for i, p in enumerate(prompts(tok, conversations))))
    return time.perf_counter() - start


async def measure(args: argparse.Namespace, routing: str) -> dict[str, float]:
    from transformers import AutoTokenizer

    from agentrl.engines.models import resolve_model
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec

    pool = RayEnginePool(RayEnginePool.Config(
        model=args.model, dtype="fp32", replicas=args.replicas, num_cpus=1, routing=routing,
        replica=ReplicaSpec(name="hf", params={"cpu_threads": 1, "max_batch_size": args.conversations}),
    ))  # fmt: skip
    try:
        tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
        wall = await workload(pool, tok, args.conversations, args.turns, args.max_new_tokens, args.tool_latency_s)
        reports = await asyncio.gather(*(r.health.remote() for r in pool._replicas))
        detail = (await pool.health()).detail
        routed = (detail["requests_per_replica"], detail["routed_by_prefix"], detail["routed_by_load"])
    finally:
        await pool.close()
    prefilled = sum(h.detail["prefill_tokens"] for h in reports)
    hits = sum(h.detail["prefix_cache_hit_tokens"] for h in reports)
    print(f"{routing:>12}: {wall:.1f}s, prefilled {prefilled} prompt tokens, {hits} from the prefix cache, "
          f"requests per replica, by prefix, by load {routed}; load={os.getloadavg()[0]:.2f}")  # fmt: skip
    return {"wall": wall, "prefilled": prefilled, "hit_share": hits / max(1, hits + prefilled)}


async def run(args: argparse.Namespace) -> None:
    prefix = await measure(args, "prefix")
    least = await measure(args, "least_loaded")
    print(
        f"prefill_ratio={least['prefilled'] / max(1, prefix['prefilled']):.2f} "
        f"speedup={least['wall'] / prefix['wall']:.2f} prefix_hit_share={prefix['hit_share']:.2f} "
        f"least_loaded_hit_share={least['hit_share']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tool-latency-s", type=float, default=0.5, help="mean time a tool runs between turns")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
