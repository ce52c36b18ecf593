"""Rollout-loop overhead: env steps/s with a zero-latency scripted engine and a trivial env.

Runs the full RolloutManager (groups, gates, Conversation token bookkeeping,
deadlines, metrics) pinned to one core and compares with a bare baseline in the
same run: the same engine and env driven by a plain loop with no Conversation,
no deadlines and no manager. The difference is what agentrl's machinery costs.
An env step is one `env.step` call (counted by the envs themselves and checked
against the trajectories' turns).

Baseline and managed runs alternate for `--rounds` rounds and the medians are
reported, as wall-clock rates and as rates per CPU second of this process (the
machine is shared: the CPU-time rates move less with other people's load).

A third measurement, the loop floor, runs `run_episode` alone (no manager,
no tasks) against an engine and an env that do no work at all (a fixed
completion, a fixed step result): what one env step costs in agentrl's
per-episode bookkeeping (token-exact Conversation, deadlines, per-turn
sampling, drift check, trajectory) before any engine, env or scheduling cost.
No engine or env can make the managed rate exceed it.

The goal (issue #21) is a floor, not a race: at least `GOAL_STEPS_PER_S`
(30,000) managed env steps/s on one core, over 100x what an engine serves
here. The rollout path is plain asyncio (one `asyncio.timeout` per await);
a real turn takes milliseconds to seconds, so micro-seconds per step buy nothing.

Summary line: env_steps_per_s=... baseline_steps_per_s=... overhead_us_per_step=...
env_steps_per_cpu_s=... baseline_steps_per_cpu_s=... loop_floor_steps_per_s=...
goal_env_steps_per_s=30000 meets_goal=yes|no
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.base import EngineHealth, Sampling, WeightSource
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import Env, StepResult, Task
from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode
from agentrl.rollout.manager import RolloutManager
from agentrl.types import Completion, Message

TURNS = 8
GOAL_STEPS_PER_S = 30_000
"""Managed env steps/s on one core that the rollout path must keep (issue #21)."""
ENV_CONFIG = TrivialEnvConfig(turns=TURNS)


def make_env() -> TrivialEnv:
    return TrivialEnv(ENV_CONFIG)


class _TalliedEnv(TrivialEnv):
    """A TrivialEnv that adds its env steps to a shared tally when it is freed.

    The managed run counts env steps without holding its envs: a list of every
    env ever made would grow the heap the garbage collector walks, a cost of
    the benchmark, not of the rollout loop.
    """

    def __init__(self, tally: list[int]) -> None:
        super().__init__(ENV_CONFIG)
        self._tally = tally

    def __del__(self) -> None:
        self._tally[0] += self.steps


async def managed(n_groups: int) -> tuple[int, float, float]:
    """Env steps (env.step calls) through RolloutManager, the wall time and the CPU time they took."""
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    cfg = RolloutConfig(group_size=8, groups_per_step=8, max_in_flight=64, max_staleness=1_000_000,
                        queue_groups=64, max_turns=TURNS, max_total_tokens=4096)
    tasks = ({"id": f"t{i}", "prompt": "go"} for i in range(n_groups))
    tally = [0]  # env steps of the envs freed so far: the run keeps no env alive, as `agentrl train` does not

    def env_factory() -> TrivialEnv:
        return _TalliedEnv(tally)

    turns = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    async with RolloutManager(env_factory, tasks, engine, tok, cfg) as manager:
        async for group in manager.groups():
            turns += sum(len(t.turns) for t in group.trajectories)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    gc.collect()  # every env is freed by now (refcounts; this catches any in a cycle)
    steps = tally[0]
    if steps != turns or steps != n_groups * cfg.group_size * TURNS:
        raise RuntimeError(f"expected {n_groups * cfg.group_size * TURNS} env steps, got {steps} ({turns} turns)")
    return steps, elapsed, cpu


async def baseline(n_episodes: int) -> tuple[int, float, float]:
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

    start, cpu_start = time.perf_counter(), time.process_time()
    for chunk in range(0, n_episodes, 64):
        steps += sum(await asyncio.gather(*(episode() for _ in range(min(64, n_episodes - chunk)))))
    return steps, time.perf_counter() - start, time.process_time() - cpu_start


class _FreeEngine:
    """Returns the same completion at once: an engine that costs nothing (the floor measurement)."""

    policy_version = 0

    def __init__(self, tok: SimpleChatTokenizer) -> None:
        ids = [*tok.encode("Fine."), tok.eos_ids[0]]
        self._completion = Completion(ids, [-1.0] * len(ids), [0] * len(ids), "stop")

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        return self._completion

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        self.policy_version = version

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, policy_version=self.policy_version)

    async def close(self) -> None:
        return None


class _FreeEnv(Env):
    """TURNS turns with fixed step results: an env that costs nothing (the floor measurement)."""

    name = "free"
    _opening = (Message(role="user", content="go"),)
    _reply = StepResult([Message(role="user", content="ok")])
    _last = StepResult([], 1.0, True)

    def __init__(self) -> None:
        super().__init__(None)
        self.steps = 0

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return ()

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        return list(self._opening), {}

    async def step(self, action: Message) -> StepResult:
        self.steps += 1
        return self._last if self.steps % TURNS == 0 else self._reply


async def floor(n_episodes: int) -> tuple[int, float, float]:
    """`run_episode` alone, one episode after another, with a free engine and env."""
    tok = SimpleChatTokenizer()
    engine = _FreeEngine(tok)
    cfg = RolloutConfig(group_size=8, max_turns=TURNS, max_total_tokens=4096)
    env = _FreeEnv()
    task: Task = {"id": "t", "prompt": "go"}
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(n_episodes):
        await run_episode(env, task, engine, tok, cfg, seed=i)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if env.steps != n_episodes * TURNS:
        raise RuntimeError(f"expected {n_episodes * TURNS} env steps, got {env.steps}")
    return env.steps, elapsed, cpu


def summary(med: dict[str, float]) -> str:
    """The one-line result from the median rates (keys: managed, baseline, managed_cpu, baseline_cpu, floor)."""
    return (
        f"env_steps_per_s={med['managed']:.0f} baseline_steps_per_s={med['baseline']:.0f} "
        f"overhead_us_per_step={1e6 / med['managed'] - 1e6 / med['baseline']:.1f} "
        f"env_steps_per_cpu_s={med['managed_cpu']:.0f} baseline_steps_per_cpu_s={med['baseline_cpu']:.0f} "
        f"loop_floor_steps_per_s={med['floor']:.0f} "
        f"goal_env_steps_per_s={GOAL_STEPS_PER_S} meets_goal={'yes' if med['managed'] >= GOAL_STEPS_PER_S else 'no'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="alternating baseline/managed rounds; medians reported")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of one managed run")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    asyncio.run(managed(50))  # warm up
    rates: dict[str, list[float]] = {"managed": [], "baseline": [], "managed_cpu": [], "baseline_cpu": [], "floor": []}
    for i in range(args.rounds):
        b_steps, b_s, b_cpu = asyncio.run(baseline(args.groups * 8))
        m_steps, m_s, m_cpu = asyncio.run(managed(args.groups))
        f_steps, f_s, _ = asyncio.run(floor(args.groups * 8))
        rates["managed"].append(m_steps / m_s)
        rates["baseline"].append(b_steps / b_s)
        rates["managed_cpu"].append(m_steps / m_cpu)
        rates["baseline_cpu"].append(b_steps / b_cpu)
        rates["floor"].append(f_steps / f_s)
        print(
            f"round {i}: managed {m_steps} env steps in {m_s:.2f}s ({m_cpu:.2f}s CPU); "
            f"baseline {b_steps} in {b_s:.2f}s ({b_cpu:.2f}s CPU); "
            f"loop floor {f_steps} in {f_s:.2f}s; load={os.getloadavg()[0]:.2f}"
        )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(managed(args.groups))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(summary({k: statistics.median(v) for k, v in rates.items()}))


if __name__ == "__main__":
    main()
