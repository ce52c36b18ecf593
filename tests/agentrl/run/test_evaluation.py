"""Held-out evaluation: independent samples and unbiased pass@k."""

from __future__ import annotations

import math

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.run.evaluation import evaluate, pass_at_k


def test_pass_at_k_matches_the_combinatorial_definition() -> None:
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
    assert pass_at_k(3, 2, 2) == 1.0  # fewer failures than k: some draw always passes


async def test_every_episode_gets_its_own_seed() -> None:
    """Equal seeds would make the samples of all tasks one correlated draw."""
    tokenizer = SimpleChatTokenizer()
    env_config = TrivialEnvConfig(turns=1, num_tasks=3)
    tasks = list(TrivialEnv(env_config).tasks("test"))
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["done"]), tokenizer=tokenizer)
    result = await evaluate(
        lambda: TrivialEnv(env_config), tasks, engine, tokenizer, RolloutConfig(max_turns=1),
        n_samples=2, ks=(1, 2), seed=100,
    )
    await engine.close()
    seeds = [t.seed for t in result.trajectories]
    assert len(seeds) == 6 and len(set(seeds)) == 6
    assert min(s for s in seeds if s is not None) == 100
    assert result.n_tasks == 3 and result.pass_at == {1: 1.0, 2: 1.0}
