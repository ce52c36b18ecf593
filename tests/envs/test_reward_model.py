"""reward_model: a tiny random HF reward model, batched off the event loop, alone or weighted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult, weighted
from agentrl.envs.reward_model import RewardModelReward
from agentrl.types import Message

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny_rm_path(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any) -> str:
    """A random 2-layer Llama reward head (num_labels=1) with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out: Path = tmp_path_factory.mktemp("tiny-rm")
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1,
        pad_token_id=smol_tokenizer.pad_token_id if smol_tokenizer.pad_token_id is not None
        else smol_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)
    smol_tokenizer.save_pretrained(out)
    return str(out)


def conversation(answer: str) -> list[Message]:
    return [Message(role="user", content="What is 2 + 2?"), Message(role="assistant", content=answer)]


def reference_scores(path: str, texts: Sequence[str]) -> list[float]:
    """One forward pass per text, no padding: what batching must reproduce."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt", add_special_tokens=False)
            out.append(float(model(**ids).logits[0, 0]))
    return out


async def test_batched_scores_match_single_forward_passes(tiny_rm_path: str) -> None:
    rm = RewardModelReward(model=tiny_rm_path, batch_size=4, max_wait_ms=50)
    answers = ["4", "It is four.", "5", "The answer is 4, because two plus two makes four.", "22", "four"]
    try:


        results = await asyncio.gather(*(rm.score({"id": str(i)}, conversation(a)) for i, a in enumerate(answers)))
        texts = [await rm._render(conversation(a)) for a in answers]
    finally:
        await rm.close()
    assert "<|im_start|>assistant" in texts[0]  # the model's chat template was used
    expected = reference_scores(tiny_rm_path, texts)
    assert [r.value for r in results] == pytest.approx(expected, abs=1e-4)
    assert len({round(r.value, 6) for r in results}) > 1  # a random head still separates inputs
    assert rm.stats == {"batches": 2, "items": 6}  # 6 concurrent calls -> batches of 4 + 2
    assert rm.worker_threads and threading.get_ident() not in rm.worker_threads


async def test_transform_and_weighted_mix_with_a_verifier(tiny_rm_path: str) -> None:
    class ExactFour:
        async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
            return RewardResult(value=float(messages[-1].content.strip() == "4"))

    rm = RewardModelReward(model=tiny_rm_path, transform="sigmoid", template="plain")
    try:
        alone = await rm.score({"id": "t"}, conversation("4"))
        mixed = await weighted([("rm", 0.5, rm), ("exact", 1.0, ExactFour())], {"id": "t"}, conversation("4"))
    finally:
        await rm.close()
    assert 0.0 < alone.value < 1.0
    assert mixed.value == pytest.approx(0.5 * alone.value + 1.0)
    assert mixed.breakdown["rm"] == pytest.approx(alone.value) and mixed.breakdown["exact"] == 1.0


async def test_bad_config_and_bad_label_are_clear(tiny_rm_path: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="batch_size"):
        RewardModelReward(model=tiny_rm_path, batch_size=0)
    rm = RewardModelReward(model=tiny_rm_path, label_index=3)
    try:
        with pytest.raises(ValueError, match="label_index=3 but the model has 1 labels"):
            await rm.score({"id": "t"}, conversation("4"))
    finally:
        await rm.close()
