"""Fixtures for the gateway tests: a real tokenizer, a scripted calculator agent model, a served gateway."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_helpers import calculator_reply

from agentrl.chat import Budgets, HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gateway import Backend, Gateway, GatewayConfig, TrainerSampling
from agentrl.tool_parsers import HermesParser


@pytest.fixture(scope="session")
def chat_tokenizer(smollm2_path: str) -> HFChatTokenizer:
    """SmolLM2's real tokenizer and ChatML template."""
    return HFChatTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def scripted(chat_tokenizer: HFChatTokenizer) -> ScriptedEngine:
    """An engine that samples real token ids (SmolLM2's tokenizer) of calculator-agent replies."""
    return ScriptedEngine(ScriptedEngine.Config(logprob=-0.5), tokenizer=chat_tokenizer, reply_fn=calculator_reply)


def make_backend(engine: Any, tokenizer: Any, **kw: Any) -> Backend:
    budgets = kw.pop("budgets", Budgets(max_turns=8, max_total_tokens=4096, max_new_tokens_per_turn=96))
    return Backend(engine=engine, tokenizer=tokenizer, parser=HermesParser(),
                   sampling=kw.pop("sampling", TrainerSampling(temperature=1.0)), budgets=budgets, **kw)


@pytest.fixture
async def gateway(scripted: ScriptedEngine, chat_tokenizer: HFChatTokenizer) -> AsyncIterator[Gateway]:
    async with Gateway(GatewayConfig(max_body_bytes=64 * 1024), make_backend(scripted, chat_tokenizer)) as gw:
        yield gw
