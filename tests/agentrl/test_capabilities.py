"""Optional capabilities are declared protocols, checked one way: `isinstance` against the protocol.

Each test holds a built-in implementer to its protocol and a consumer to what
the protocol promises; the last one keeps attribute probes from coming back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentrl.chat.tokenizers import BoundaryCaching, ChatTokenizer, SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import EpisodeDriver
from agentrl.envkit.rewards import ClosableReward, Reward, RewardResult
from agentrl.envkit.testing import TrivialEnv
from agentrl.rollout.episode import ClassifiedError, EpisodeFailure, classify
from agentrl.rollout.metrics import EngineBusy, EngineStats
from agentrl.run.resources import Closeable, close_quietly
from agentrl.run.wiring import _close_trainer
from agentrl.trainer import ClosableTrainer
from agentrl.types import ErrorClass

ROOT = Path(__file__).resolve().parents[2]


def test_built_in_implementers_satisfy_their_protocols() -> None:
    from agentrl.envs.agent import AgentEnv

    assert issubclass(AgentEnv, EpisodeDriver) and not isinstance(TrivialEnv(), EpisodeDriver)
    engine = ScriptedEngine()
    assert isinstance(engine, EngineBusy)
    tokenizer = SimpleChatTokenizer()
    assert isinstance(tokenizer, ChatTokenizer) and isinstance(tokenizer, BoundaryCaching)
    assert isinstance(EpisodeFailure(ErrorClass.TOOL, "x"), ClassifiedError)


class PluginTimeout(Exception):
    """A plugin's own exception: it names its class without importing agentrl.rollout."""

    error_class = "timeout"


def test_classify_goes_by_the_exceptions_error_class() -> None:
    assert isinstance(PluginTimeout(), ClassifiedError)
    assert classify(PluginTimeout(), ErrorClass.ENV) is ErrorClass.TIMEOUT
    assert classify(ValueError("no class"), ErrorClass.REWARD) is ErrorClass.REWARD


class _Trainer:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_the_run_closes_a_closable_trainer_and_leaves_others_be() -> None:
    trainer = _Trainer()
    assert isinstance(trainer, ClosableTrainer)
    _close_trainer(trainer)  # type: ignore[arg-type]  # only the optional half of the contract matters here
    assert trainer.closed == 1
    _close_trainer(object())  # type: ignore[arg-type]  # no close(): nothing to call


class _Reward:
    def __init__(self) -> None:
        self.closed = False

    async def score(self, task: object, messages: object) -> RewardResult:
        return RewardResult(1.0)

    async def close(self) -> None:
        self.closed = True


async def test_close_quietly_closes_sync_and_async_closeables_only() -> None:
    reward, trainer = _Reward(), _Trainer()
    assert isinstance(reward, Reward) and isinstance(reward, ClosableReward) and isinstance(reward, Closeable)
    await close_quietly(reward)
    await close_quietly(trainer)
    await close_quietly(object())
    assert reward.closed and trainer.closed == 1


class _StatsEngine:
    def stats(self) -> dict[str, float]:
        return {"replicas_alive": 2.0}


def test_engine_metric_protocols_are_independent() -> None:
    assert isinstance(_StatsEngine(), EngineStats) and not isinstance(_StatsEngine(), EngineBusy)


PROBES = re.compile(
    r"(?:getattr|hasattr)\([^,()]+, \"(drive_episode|busy_seconds|stats|boundary_cache|error_class|close|"
    r"generate_stream|memory_stats|share_base_with|weights_wanted|lora_policy_for_engine|sent_bytes|sent_buckets)\""
)


NOT_YET = ("agentrl/weights/sender.py", "envs/terminal.py")
"""Probes left: the trainer-side sender's reads of its source's counters (`raw_buckets`, `sent_bytes`), and
the terminal env's reads of `WorkspaceError.error_class`; docs/plugins.md lists them."""


@pytest.mark.parametrize("folder", ["agentrl", "envs", "trainers"])
def test_no_attribute_probe_for_a_declared_capability(folder: str) -> None:
    """The capabilities above are found by isinstance only, nowhere by attribute (but `NOT_YET`)."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_YET):
            continue
        found += [f"{rel}: {m.group(0)}" for m in PROBES.finditer(path.read_text())]
    assert found == []
