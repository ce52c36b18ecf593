"""The embedded engine on CUDA (pytest -m gpu), weights from a trainer on the same device, and the
`synthetic:` model specs the GPU check trains (scripts/gpu_check.sh).

The gpu-marked tests run on `gpu_test_device()` (tests/gpu_device.py): CUDA, or
the CPU when AGENTRL_TEST_DEVICE=cpu, else they skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_device import gpu_test_device

gpu = pytest.mark.gpu


@pytest.fixture
def device() -> str:
    return gpu_test_device()


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentrl.engines.models import resolve_model

    return resolve_model("synthetic:llama-tiny")


def _groups(num_groups: int, size: int, seed: int) -> list[Any]:
    """Random one-turn groups (prompt mask 0, completion mask 1, made-up behaviour logprobs) to train on."""
    import random

    from agentrl.types import Group, Trajectory, Turn

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(1, 2000) for _ in range(8)]
        trajs = []
        for _ in range(size):
            completion = [rng.randrange(1, 2000) for _ in range(rng.randint(4, 12))]
            n, m = len(prompt), len(completion)
            trajs.append(Trajectory(
                task_id=f"t{g}", env="test", messages=[], token_ids=prompt + completion, loss_mask=[0] * n + [1] * m,
                logprobs=[0.0] * n + [-1.5] * m, versions=[-1] * n + [0] * m, turns=[Turn(start=n, end=n + m)],
                reward=float(rng.random() < 0.5), group_id=f"g{g}",
            ))  # fmt: skip
        groups.append(Group(task_id=f"t{g}", trajectories=trajs, id=f"g{g}"))
    return groups


def _engine(model_path: str, device: str, **config: Any) -> Any:
    from agentrl.engines.hf import HFEngine

    return HFEngine(HFEngine.Config(model=model_path, device=device, stop_on_eos=False, **config))


@gpu
@pytest.mark.model
async def test_the_engine_runs_on_the_device_and_decodes_greedily_like_hf_generate(model_path: str, device: str) -> None:
    """engine.device places the model; greedy decoding of two concurrent prompts (one KV batch) gives HF
    generate's tokens on the same device, and sampled logprobs are proper (<= 0, finite)."""
    import asyncio

    from agentrl.engines.base import Sampling

    async with _engine(model_path, device, dtype="fp32") as engine:
        assert {p.device.type for p in engine.model.parameters()} == {device}
        prompts = [[1, 400, 401, 402, 403], [1, 900, 901]]
        greedy = Sampling(max_tokens=12, temperature=0.0)
        outs = await asyncio.wait_for(asyncio.gather(*(engine.generate(p, greedy) for p in prompts)), 120)
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt], device=device)
            want = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            assert out.ids == want[0, len(prompt) :].tolist()
        sampled = await asyncio.wait_for(engine.generate(prompts[0], Sampling(max_tokens=16, temperature=1.0, seed=3)), 120)
        assert len(sampled.ids) == 16 and all(-1e4 < lp <= 0.0 for lp in sampled.logprobs)


@gpu
@pytest.mark.model
@pytest.mark.parametrize(("lora", "engine_dtype"), [(False, "fp32"), (True, "bf16")], ids=["full_fp32", "lora_bf16"])
async def test_weight_buckets_from_a_trainer_on_the_device_land_in_an_engine_on_the_device(
    model_path: str, device: str, lora: bool, engine_dtype: str
) -> None:
    """After a train step, sync_weights sends the trainer's weights (LoRA merged) in small buckets; every engine
    parameter then equals the trainer's tensor in the engine's dtype, and the engine serves the new version."""
    import asyncio

    from agentrl.engines.base import Sampling
    from agentrl.run.wiring import sync_weights
    from agentrl.trainers.torch_trainer import TorchTrainer

    config: dict[str, Any] = {"dtype": "fp32", "lr": 1e-2, "device": device, "weight_bucket_mb": 0.25}
    if lora:
        config["lora"] = {"r": 4, "alpha": 8}
    trainer = TorchTrainer(config, model_path)
    trainer.train_step(_groups(2, 3, seed=4))
    async with _engine(model_path, device, dtype=engine_dtype) as engine:
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        metrics = await asyncio.wait_for(sync_weights(engine, trainer), 120)
        assert engine.policy_version == trainer.policy_version == 1
        assert metrics["weight_sync/buckets"] > 1
        want = dict(t for bucket in trainer.state_for_engines().buckets() for t in bucket)
        changed = 0
        for name, param in engine.model.named_parameters():
            assert param.device.type == device
            expected = want[name].to(device=param.device, dtype=param.dtype)
            assert torch.equal(param.detach(), expected), name
            changed += not torch.equal(param.detach(), before[name])
        assert changed > 0, "the synced weights equal the initial ones: the step or the sync did nothing"
        out = await asyncio.wait_for(engine.generate([1, 400, 401], Sampling(max_tokens=4, temperature=1.0)), 120)
        assert out.versions == [1] * 4


@pytest.mark.model
def test_synthetic_specs_build_a_seeded_llama_with_the_carried_tokenizer_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_path: str
) -> None:
    """`synthetic:llama-tiny` is written once to the cache with the tokenizer of $AGENTRL_SYNTHETIC_TOKENIZER
    (its vocabulary and chat template), loads as a Llama, and is reused; `synthetic:llama-0.5b` has ~0.5B
    parameters; an unknown shape or a missing tokenizer directory is refused by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.engines.models import SYNTHETIC, ModelNotAvailable, resolve_model, synthetic_llama_config

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AGENTRL_SYNTHETIC_TOKENIZER", smollm2_path)
    path = Path(resolve_model("synthetic:llama-tiny"))
    assert path.is_relative_to(tmp_path / "cache")
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model("SYNTHETIC:llama-tiny") == str(path) and weights.stat().st_mtime_ns == stamp
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == len(AutoTokenizer.from_pretrained(smollm2_path)) and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tok)
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(synthetic_llama_config(SYNTHETIC["llama-0.5b"], tok))
    assert 0.4e9 < sum(p.numel() for p in big.parameters()) < 0.6e9

    with pytest.raises(ModelNotAvailable, match=r"unknown synthetic shape 'llama-7b' \(allowed: synthetic:llama-0.5b"):
        resolve_model("synthetic:llama-7b")
    monkeypatch.setenv("AGENTRL_SYNTHETIC_TOKENIZER", str(tmp_path / "nowhere"))
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "other"))
    with pytest.raises(ModelNotAvailable, match=r"AGENTRL_SYNTHETIC_TOKENIZER=.*nowhere.* is not a directory"):
        resolve_model("synthetic:llama-tiny")
