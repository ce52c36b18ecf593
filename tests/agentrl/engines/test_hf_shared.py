"""One copy of the base: the embedded hf engine samples with the LoRA trainer's own frozen tensors."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agentrl.engines.base import Sampling  # noqa: E402
from agentrl.engines.hf import HFEngine  # noqa: E402
from agentrl.run.wiring import sync_weights  # noqa: E402
from agentrl.trainers.logprobs import packed_logprobs  # noqa: E402
from agentrl.trainers.torch_trainer import TorchTrainer  # noqa: E402

pytestmark = pytest.mark.model


def _engine(path: str) -> HFEngine:
    return HFEngine(HFEngine.Config(model=path, dtype="fp32", max_batch_size=4, seed=3))


def _trainer_logprobs(trainer: TorchTrainer, prompt: list[int], ids: list[int]) -> Any:
    """The trainer's own scoring path (packed attention, chunked lm_head) on prompt + ids."""
    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp, _ = packed_logprobs(trainer.model, tokens, torch.arange(tokens.shape[1]).unsqueeze(0))
    return lp[len(prompt) :]


def _perturb_adapters(trainer: TorchTrainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)


async def test_engine_shares_the_frozen_base_and_a_sync_hands_over_the_adapter(tiny_llama_path: str) -> None:
    trainer = TorchTrainer({"lora": {"r": 4, "alpha": 8}}, tiny_llama_path)
    engine = _engine(tiny_llama_path)
    try:
        full_mb = sum(p.numel() * 4 for p in engine.model.parameters()) / 2**20
        assert engine.share_base_with(trainer)
        frozen = {p.data_ptr() for p in trainer.model.parameters() if not p.requires_grad}
        adapters = {p.data_ptr() for p in trainer.model.parameters() if p.requires_grad}
        engine_ptrs = {p.data_ptr() for p in engine.model.parameters()}
        assert frozen <= engine_ptrs  # every base tensor is the trainer's own storage
        assert not adapters & engine_ptrs  # the adapter is the engine's copy
        stats = engine.memory_stats()
        assert stats["weights_mb"] < 0.1 * full_mb and stats["prefix_cache_mb"] == 0

        prompt = engine.tokenizer.encode("The quick brown fox")
        sampling = Sampling(max_tokens=12, temperature=1.0, seed=11)
        _perturb_adapters(trainer, seed=1)  # the trainer's step, not synced yet
        stale = await engine.generate(prompt, sampling)
        gap = (_trainer_logprobs(trainer, prompt, stale.ids) - torch.tensor(stale.logprobs)).abs().max()
        assert float(gap) > 1e-3, "the engine must keep serving its own adapter until a sync"

        trainer.policy_version = 1
        metrics = await sync_weights(engine, trainer)
        assert engine.policy_version == 1
        assert 0 < metrics["weight_sync/mb"] < 0.02 * full_mb  # adapter only, no merged model
        out = await engine.generate(prompt, sampling)
        assert out.versions == [1] * len(out.ids)
        diff = (_trainer_logprobs(trainer, prompt, out.ids) - torch.tensor(out.logprobs)).abs().max()
        assert float(diff) < 1e-4, float(diff)
        assert {p.data_ptr() for p in engine.model.parameters()} >= frozen  # still one copy after the sync
    finally:
        await engine.close()


async def test_full_fine_tuning_keeps_the_engines_own_merged_path(tiny_llama_path: str) -> None:
    trainer = TorchTrainer({}, tiny_llama_path)
    engine = _engine(tiny_llama_path)
    try:
        assert not engine.share_base_with(trainer)
        assert engine.weights_wanted == "full"
        assert not {p.data_ptr() for p in trainer.model.parameters()} & {p.data_ptr() for p in engine.model.parameters()}
        trainer.policy_version = 1
        metrics = await sync_weights(engine, trainer)
        assert metrics["weight_sync/mb"] > 0.9 * sum(p.numel() * 4 for p in engine.model.parameters()) / 2**20
    finally:
        await engine.close()


async def test_the_engine_can_opt_out(tiny_llama_path: str) -> None:
    trainer = TorchTrainer({"lora": {"r": 4, "alpha": 8}}, tiny_llama_path)
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", share_trainer_base=False))
    try:
        assert not engine.share_base_with(trainer) and engine.weights_wanted == "full"
    finally:
        await engine.close()



@pytest.mark.parametrize(("engine_dtype", "shares"), [("auto", True), ("bf16", False)])
async def test_an_auto_dtype_engine_takes_the_trainers_dtype(
    tiny_llama_path: str, tmp_path: Any, engine_dtype: str, shares: bool
) -> None:
    """A bf16 checkpoint beside an fp32 LoRA trainer: `dtype: auto` shares its base (sampling in fp32,
    one copy, adapter-only syncs); an engine pinned to bf16 keeps its own model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(bf16_dir)
    trainer = TorchTrainer({"lora": {"r": 4, "alpha": 8}}, str(bf16_dir))
    engine = HFEngine(HFEngine.Config(model=str(bf16_dir), dtype=engine_dtype, max_batch_size=2))
    try:
        assert next(engine.model.parameters()).dtype == torch.bfloat16  # the checkpoint's dtype
        assert engine.share_base_with(trainer) is shares
        assert engine.weights_wanted == ("adapter" if shares else "full")
        assert {p.dtype for p in engine.model.parameters()} == ({torch.float32} if shares else {torch.bfloat16})
        out = await engine.generate([5, 6, 7], Sampling(max_tokens=3, temperature=0.0))
        assert len(out.ids) >= 1
    finally:
        await engine.close()
