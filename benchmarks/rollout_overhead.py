"""Rollout-loop overhead: env steps/s with a zero-latency scripted engine and a trivial env.

Runs the full RolloutManager (groups, gates, Conversation token bookkeeping,
deadlines, metrics) on one core and compares with a bare baseline in the same
run: the same engine and env driven by a plain loop with no Conversation, no
deadlines and no manager. The difference is what agentrl's machinery costs.

Summary line: env_steps_per_s=... baseline_steps_per_s=... overhead_us_per_step=...
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import time

from agentrl.chat import SimpleChatTokenizer
from agentrl.engines.base import Sampling
from agentrl.engines.scripted import ScriptedEngine
from agentrl.rollout import RolloutManager
from agentrl.rollout_config import RolloutConfig
from agentrl.testing_envs import TrivialEnv, TrivialEnvConfig

TURNS = 8
ENV_CONFIG = TrivialEnvConfig(turns=TURNS)


def make_env() -> TrivialEnv:
    return TrivialEnv(ENV_CONFIG)


async def managed(n_groups: int) -> tuple[int, float]:
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    cfg = RolloutConfig(group_size=8, groups_per_step=8, max_in_flight=64, max_staleness=1_000_000,
                        queue_groups=64, max_turns=TURNS, max_total_tokens=4096)
    tasks = ({"id": f"t{i}", "prompt": "go"} for i in range(n_groups))
    steps = 0
    start = time.perf_counter()
    async with RolloutManager(make_env, tasks, engine, tok, cfg) as manager:
        async for group in manager.groups():
            steps += sum(len(t.turns) for t in group.trajectories)
    return steps, time.perf_counter() - start


async def baseline(n_episodes: int) -> tuple[int, float]:
    """The same engine and env in a bare loop: what asyncio + the env + the engine cost alone."""
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    sampling = Sampling(max_tokens=64, stop_ids=tok.eos_ids)
    steps = 0

    async def episode() -> int:
        env = make_env()
        messages, _ = await env.reset({"id": "t", "prompt": "go"})
        ids = tok.encode(messages[0].content)
        n = 0
        while True:
            completion = await engine.generate(ids, sampling)
            result = await env.step(env.parse_action(tok.decode(completion.ids[:-1])))
            n += 1
            if result.terminated:
                return n

    start = time.perf_counter()
    for chunk in range(0, n_episodes, 64):
        steps += sum(await asyncio.gather(*(episode() for _ in range(min(64, n_episodes - chunk)))))
    return steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of the managed run")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    asyncio.run(managed(50))  # warm up
    b_steps, b_s = asyncio.run(baseline(args.groups * 8))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    m_steps, m_s = asyncio.run(managed(args.groups))
    if args.profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    managed_rate, base_rate = m_steps / m_s, b_steps / b_s
    print(f"managed: {m_steps} env steps in {m_s:.2f}s; baseline: {b_steps} in {b_s:.2f}s; load={os.getloadavg()[0]:.2f}")
    print(
        f"env_steps_per_s={managed_rate:.0f} baseline_steps_per_s={base_rate:.0f} "
        f"overhead_us_per_step={1e6 / managed_rate - 1e6 / base_rate:.1f}"
    )


if __name__ == "__main__":
    main()
