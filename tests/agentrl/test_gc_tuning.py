"""`gc_threshold`: the collector setting `agentrl train` and `agentrl eval` run under."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl import loop
from agentrl.chat import SimpleChatTokenizer
from agentrl.config import RunConfig
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gc_tuning import gc_threshold
from agentrl.rollout import RolloutManager
from agentrl.rollout_config import RolloutConfig
from agentrl.testing_envs import TrivialEnv, TrivialEnvConfig


@pytest.fixture(autouse=True)
def python_default() -> Iterator[None]:
    """Each test starts from the interpreter's thresholds and leaves them as it found them."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_sets_the_youngest_threshold_and_restores_all_three() -> None:
    with gc_threshold(10_000):
        assert gc.get_threshold() == (10_000, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(RuntimeError), gc_threshold(5_000):
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_zero_leaves_the_interpreter_setting_and_negative_is_an_error() -> None:
    gc.set_threshold(1234, 5, 6)
    with gc_threshold(0):
        assert gc.get_threshold() == (1234, 5, 6)
    with pytest.raises(ValueError, match=">= 0"), gc_threshold(-1):
        pass


async def _young_collections(gen0: int) -> int:
    """Generation-0 collections while 100 groups of 8 four-turn episodes run through a RolloutManager."""
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    cfg = RolloutConfig(group_size=8, groups_per_step=8, max_in_flight=64, max_staleness=1000, queue_groups=64,
                        max_turns=4, max_total_tokens=4096)  # fmt: skip
    tasks = ({"id": f"t{i}", "prompt": "go"} for i in range(100))
    groups = 0
    with gc_threshold(gen0):
        before = gc.get_stats()[0]["collections"]
        async with RolloutManager(lambda: TrivialEnv(TrivialEnvConfig(turns=4)), tasks, engine, tok, cfg) as m:
            async for _ in m.groups():
                groups += 1
        collections: int = gc.get_stats()[0]["collections"] - before
    assert groups == 100
    return collections


async def test_the_run_setting_makes_young_collections_rare_during_rollouts() -> None:
    default = await _young_collections(700)
    tuned = await _young_collections(RunConfig.model_fields["run"].default.gc_threshold)
    assert default >= 20  # the rollout really allocates enough to collect at Python's setting
    assert tuned * 5 <= default


async def test_train_runs_under_the_configured_threshold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[Any] = []

    async def once(cfg: RunConfig, attempt: Any) -> Path:
        seen.append(gc.get_threshold())
        raise RuntimeError("the run failed")

    monkeypatch.setattr(loop, "_train_once", once)
    config = RunConfig.model_validate({"env": "calculator", "run": {"gc_threshold": 25_000}})
    with pytest.raises(RuntimeError, match="failed"):
        await loop.train(config)
    assert seen == [(25_000, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)  # restored, even after a failure
