"""A replica lost under load: what the `ray` engine pool's clients see, and how long healing takes.

Two `hf` replicas of SmolLM2-135M-Instruct (fp32, one CPU thread each) serve
`--clients` concurrent clients that send chat prompts back to back (replies
of `--max-new-tokens`). After a weight update to version 1, the run measures
three windows against each other:

- healthy: `--window-s` seconds with both replicas up (the baseline, same run);
- degraded: from killing one replica (`ray.kill`, as a crashed process) until
  the pool has rebuilt it and loaded version 1 into it;
- healed: `--window-s` seconds after that.

It counts requests that failed (a client-visible error: the contract says none),
completions that carried another version than 1 (the restarted replica must
not serve the base weights), the recovery time, and sampled tokens/s per window.

Summary line: failed_requests=... wrong_version_tokens=... recovery_s=...
degraded_vs_healthy=<tokens/s ratio> healed_vs_healthy=<tokens/s ratio>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Load:
    """Clients sending requests back to back; tokens and failures counted per window."""

    def __init__(self, pool: Any, prompts: list[list[int]], max_new: int) -> None:
        self.pool, self.prompts, self.max_new = pool, prompts, max_new
        self.tokens = self.failed = self.wrong_version = 0
        self.stop = False

    async def client(self, i: int) -> None:
        from agentrl.engines.base import Sampling

        n = 0
        while not self.stop:
            prompt = self.prompts[(i + n) % len(self.prompts)]
            n += 1
            try:
                out = await self.pool.generate(prompt, Sampling(max_tokens=self.max_new, seed=n))
            except Exception as e:  # the pool's contract: a lost replica is not a client's error
                self.failed += 1
                print(f"client {i}: request failed: {type(e).__name__}: {e}")
                continue
            self.tokens += len(out.ids)
            self.wrong_version += sum(v != 1 for v in out.versions)

    async def window(self, until: Any) -> tuple[float, float]:
        """Tokens/s and seconds from now until `until()` returns (awaited)."""
        start, tokens = time.perf_counter(), self.tokens
        await until()
        wall = time.perf_counter() - start
        return (self.tokens - tokens) / wall, wall


async def run(args: argparse.Namespace) -> None:
    import ray
    from hf_engine import prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.engines.models import resolve_model
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    path = resolve_model(args.model)
    pool = RayEnginePool(RayEnginePool.Config(
        model=args.model, dtype="fp32", replicas=2, num_cpus=1, routing="least_loaded", restart_backoff_s=1.0,
        replica=ReplicaSpec(name="hf", params={"cpu_threads": 1}),
    ))  # fmt: skip
    try:
        trainer_side = AutoModelForCausalLM.from_pretrained(path)
        await pool.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(trainer_side), bucket_mb=64), 1)
        load = Load(pool, prompts(AutoTokenizer.from_pretrained(path), 16), args.max_new_tokens)
        clients = [asyncio.create_task(load.client(i)) for i in range(args.clients)]
        await asyncio.sleep(2.0)  # warm up

        async def restarted() -> None:
            while pool.restarted < 1:
                await asyncio.sleep(0.05)

        healthy, _ = await load.window(lambda: asyncio.sleep(args.window_s))
        ray.kill(pool._replicas[0])
        degraded, recovery = await load.window(restarted)
        healed, _ = await load.window(lambda: asyncio.sleep(args.window_s))
        load.stop = True
        await asyncio.gather(*clients)
    finally:
        await pool.close()
    print(f"healthy {healthy:.1f} tok/s; replica killed, back with version 1 after {recovery:.1f}s "
          f"({degraded:.1f} tok/s meanwhile); healed {healed:.1f} tok/s; load={os.getloadavg()[0]:.2f}")  # fmt: skip
    print(
        f"failed_requests={load.failed} wrong_version_tokens={load.wrong_version} recovery_s={recovery:.1f} "
        f"degraded_vs_healthy={degraded / healthy:.2f} healed_vs_healthy={healed / healthy:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=20.0, help="length of the healthy and healed windows")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
