"""Fixtures for the gateway tests: a real tokenizer, a scripted calculator agent model, a served gateway."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_helpers import calculator_reply, make_backend

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gateway import Gateway, GatewayConfig


@pytest.fixture(scope="session")
def chat_tokenizer(smollm2_path: str) -> HFChatTokenizer:
    """SmolLM2's real tokenizer and ChatML template."""
    return HFChatTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def scripted(chat_tokenizer: HFChatTokenizer) -> ScriptedEngine:
    """An engine that samples real token ids (SmolLM2's tokenizer) of calculator-agent replies."""
    return ScriptedEngine(ScriptedEngine.Config(logprob=-0.5), tokenizer=chat_tokenizer, reply_fn=calculator_reply)


@pytest.fixture
async def gateway(scripted: ScriptedEngine, chat_tokenizer: HFChatTokenizer) -> AsyncIterator[Gateway]:
    async with Gateway(GatewayConfig(max_body_bytes=64 * 1024), make_backend(scripted, chat_tokenizer)) as gw:
        yield gw
