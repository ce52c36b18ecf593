"""Asynchronous vs synchronous rollouts: groups/s at max_staleness 0, 1 and 4, same run.

A scripted engine with a bounded number of generation slots and long-tailed
(lognormal) reply lengths, an env with lognormal step latency (tool time), and
a trainer step of fixed duration (a trainer on its own device, modelled by a
sleep). Each mode runs the same number of training steps with the real
RolloutManager and loop shape: take groups_per_step groups, "train", push the
new version to the engine, move the staleness gate.

Engine busy = slot-seconds used / slot-seconds available over the mode's wall time.
Summary line: speedup_s4=<groups/s at s4 / groups/s at s0> engine_busy_s4=... (+ s1, s0 figures)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import Distribution, ScriptedEngine
from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager


async def run_mode(staleness: int, args: argparse.Namespace) -> tuple[float, float, float]:
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(
        ScriptedEngine.Config(
            replies=["x"],
            length=Distribution(kind="lognormal", median=args.median_tokens, sigma=args.sigma, cap=args.max_tokens),
            per_token_s=args.per_token_s,
            max_concurrency=args.slots,
            seed=staleness,
        ),
        tokenizer=tok,
    )
    env_cfg = TrivialEnvConfig(
        turns=args.turns, step_latency_s=Distribution(kind="lognormal", median=args.env_s, sigma=1.0, cap=1.0)
    )
    cfg = RolloutConfig(
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        max_in_flight=args.max_in_flight,
        max_staleness=staleness,
        queue_groups=args.groups_per_step * (staleness + 1),
        max_turns=args.turns,
        max_total_tokens=100_000,
        max_new_tokens_per_turn=args.max_tokens + 1,
    )
    tasks = ({"id": f"t{i}", "prompt": "go"} for i in range(1_000_000))
    version, groups = 0, 0
    async with RolloutManager(lambda: TrivialEnv(env_cfg), tasks, engine, tok, cfg) as manager:
        stream = manager.groups()
        engine.reset_busy()
        start = time.perf_counter()
        busy0 = engine.busy_seconds()
        for _ in range(args.steps):
            batch = [await anext(stream) for _ in range(args.groups_per_step)]
            groups += len(batch)
            await asyncio.sleep(args.train_s)  # the optimizer step
            version += 1
            engine.set_version(version)  # weights pushed to the engine: the staleness gate moves with them
        wall = time.perf_counter() - start
        busy = (engine.busy_seconds() - busy0) / wall
        await stream.aclose()
    return groups / wall, busy, wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=128)
    p.add_argument("--slots", type=int, default=20)
    p.add_argument("--per-token-s", type=float, default=0.0005)
    p.add_argument("--median-tokens", type=float, default=100)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=float, default=2000)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--env-s", type=float, default=0.02)
    p.add_argument("--train-s", type=float, default=0.3)
    args = p.parse_args()
    results = {}
    for s in (0, 1, 4):
        rate, busy, wall = asyncio.run(run_mode(s, args))
        results[s] = (rate, busy)
        print(f"max_staleness={s}: {rate:.2f} groups/s, engine busy {busy:.2f}, {wall:.1f}s")
    base = results[0][0]
    print(f"load={os.getloadavg()[0]:.2f}")
    print(
        f"speedup_s4={results[4][0] / base:.2f} engine_busy_s4={results[4][1]:.2f} "
        f"speedup_s1={results[1][0] / base:.2f} engine_busy_s1={results[1][1]:.2f} engine_busy_s0={results[0][1]:.2f}"
    )


if __name__ == "__main__":
    main()
