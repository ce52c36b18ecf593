"""benchmarks/rollout_overhead.py: each measurement runs the whole loop it claims to measure.

A rate is only meaningful if the episodes behind it ran every turn without an
error: an episode that fails at turn 1 is cheap and would inflate the number.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode


@pytest.fixture(scope="module")
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("rollout_overhead")


def test_floor_episode_runs_every_turn_through_the_full_bookkeeping(bench: ModuleType) -> None:
    tok = SimpleChatTokenizer()
    cfg = RolloutConfig(group_size=8, max_turns=bench.TURNS, max_total_tokens=4096)

    async def one() -> object:
        return await run_episode(bench._FreeEnv(), {"id": "t", "prompt": "go"}, bench._FreeEngine(tok), tok, cfg, seed=1)

    traj = asyncio.run(one())
    assert traj.error is None
    assert len(traj.turns) == bench.TURNS
    assert traj.terminated and traj.reward == 1.0
    assert traj.metrics["retokenization_drift"] == 0.0  # the token-exact path, drift check included
    assert sum(traj.loss_mask) == bench.TURNS * len(bench._FreeEngine(tok)._completion.ids)


@pytest.mark.parametrize("mode", ["floor", "baseline", "managed"])
def test_each_measurement_counts_the_env_steps_it_ran(bench: ModuleType, mode: str) -> None:
    n = 2
    steps, wall_s, cpu_s = asyncio.run(getattr(bench, mode)(n))
    per_episode = bench.TURNS * (8 if mode == "managed" else 1)  # managed takes groups of 8
    assert steps == n * per_episode
    assert wall_s > 0 and cpu_s >= 0


def test_the_summary_line_reads_against_the_30k_floor(bench: ModuleType) -> None:
    rates = {"managed": 45_000.0, "baseline": 90_000.0, "managed_cpu": 50_000.0, "baseline_cpu": 95_000.0,
             "floor": 60_000.0}
    line = bench.summary(rates)
    assert line.startswith("env_steps_per_s=45000 baseline_steps_per_s=90000 overhead_us_per_step=11.1 ")
    assert line.endswith("goal_env_steps_per_s=30000 meets_goal=yes")
    assert bench.summary({**rates, "managed": 29_999.0}).endswith("meets_goal=no")
