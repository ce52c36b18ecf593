"""Run wiring: the probe env that lists tasks is closed with the run, even if the engine fails to close."""

from __future__ import annotations

import pytest

from agentrl.chat import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.testing_envs import TrivialEnv
from agentrl.wiring import EvalParts


class ClosingEnv(TrivialEnv):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class BrokenEngine(ScriptedEngine):
    async def close(self) -> None:
        raise RuntimeError("engine close failed")


async def test_closing_the_parts_closes_the_probe_env() -> None:
    tokenizer = SimpleChatTokenizer()
    probe = ClosingEnv()
    parts = EvalParts(ClosingEnv, probe, [], ScriptedEngine(tokenizer=tokenizer), tokenizer)
    await parts.close()
    assert probe.closed == 1

    broken = EvalParts(ClosingEnv, probe, [], BrokenEngine(tokenizer=tokenizer), tokenizer)
    with pytest.raises(RuntimeError, match="engine close failed"):
        await broken.close()
    assert probe.closed == 2
