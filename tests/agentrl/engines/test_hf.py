"""The hf engine on a tiny random Llama: exact logprobs, greedy parity, stops, weights, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine_reference import reference_logprobs  # noqa: E402

from agentrl.engines.base import InferenceEngine, Sampling  # noqa: E402
from agentrl.engines.hf import EngineClosed, HFEngine  # noqa: E402

pytestmark = pytest.mark.model

TEXTS = ["Hello there, how", "The quick brown fox jumps over", "1 2 3", "aaa", "def f(x):\n    return"]


@pytest.fixture
async def engine(tiny_llama_path: str) -> Any:
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", max_batch_size=4))
    yield eng
    await eng.close()


def prompts(eng: HFEngine) -> list[list[int]]:
    return [eng.tokenizer.encode(t) for t in TEXTS]


async def staggered(eng: HFEngine, ps: Sequence[list[int]], samplings: Sequence[Sampling]) -> list[Any]:
    """Start requests a few decode steps apart so admission merges into a running batch."""
    tasks = []
    for p, s in zip(ps, samplings, strict=True):
        tasks.append(asyncio.create_task(eng.generate(p, s)))
        start = eng.steps
        while eng.steps < start + 2 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.001)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


async def test_logprobs_match_a_forward_pass(engine: HFEngine) -> None:
    assert isinstance(engine, InferenceEngine)
    ps = prompts(engine)
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=1.0, top_k=50, top_p=0.8),
        dict(temperature=1.0),
    ]
    samplings = [Sampling(max_tokens=16, seed=i, **kw) for i, kw in enumerate(settings)]  # type: ignore[arg-type]
    outs = await staggered(engine, ps, samplings)
    worst = 0.0
    for p, kw, out in zip(ps, settings, outs, strict=True):
        assert len(out.ids) >= 1
        ref = reference_logprobs(engine.model, p, out.ids, **kw)  # type: ignore[arg-type]
        assert torch.isfinite(ref).all(), "a sampled token lies outside the filtered distribution"
        worst = max(worst, float((ref - torch.tensor(out.logprobs)).abs().max()))
    print(f"max |engine logprob - forward logprob| = {worst:.3g}")
    assert worst < 1e-4


async def test_seeded_sampling_is_reproducible(engine: HFEngine) -> None:
    p = prompts(engine)[0]
    a = await engine.generate(p, Sampling(max_tokens=12, seed=7))
    b = await engine.generate(p, Sampling(max_tokens=12, seed=7))
    assert a.ids == b.ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


async def test_temperature_zero_equals_hf_generate_greedy(engine: HFEngine) -> None:
    ps = prompts(engine)
    outs = await staggered(engine, ps, [Sampling(max_tokens=12, temperature=0.0)] * len(ps))
    for p, out in zip(ps, outs, strict=True):
        with torch.no_grad():
            ref = engine.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :]
        assert out.ids == ref.tolist()[: len(out.ids)]
        assert out.finish_reason == ("stop" if out.ids[-1] == engine.model.generation_config.eos_token_id else "length")


async def test_stop_strings_and_stop_ids(engine: HFEngine) -> None:
    tok = engine.tokenizer
    greedy = Sampling(max_tokens=12, temperature=0.0)
    checked = 0
    for p in prompts(engine):
        ids = (await engine.generate(p, greedy)).ids
        # the first token whose text is new: stopping at it must end the reply right there
        for k in range(1, len(ids)):
            piece = tok.decode([ids[k]])
            if piece.strip() and piece not in tok.decode(ids[:k]) and ids[k] not in ids[:k]:
                by_str = await engine.generate(p, Sampling(max_tokens=12, temperature=0.0, stop_strings=(piece,)))
                assert by_str.ids == ids[: k + 1] and by_str.finish_reason == "stop"
                by_id = await engine.generate(p, Sampling(max_tokens=12, temperature=0.0, stop_ids=(ids[k],)))
                assert by_id.ids == ids[: k + 1] and by_id.finish_reason == "stop"
                checked += 1
                break
    assert checked >= 2


class StateDict:
    def __init__(self, tensors: dict[str, Any], bucket: int = 3) -> None:
        self.tensors, self.bucket = tensors, bucket

    def buckets(self) -> Iterator[list[tuple[str, Any]]]:
        items = list(self.tensors.items())
        for i in range(0, len(items), self.bucket):
            yield items[i : i + self.bucket]


def perturbed(model: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


async def wait_tokens(eng: HFEngine, n: int) -> None:
    async with asyncio.timeout(60):
        while eng.tokens_generated < n:
            await asyncio.sleep(0.001)


async def test_update_weights_continue_new_tags_tokens(tiny_llama_path: str) -> None:
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", stop_on_eos=False))
    try:
        p = eng.tokenizer.encode("Once upon a time")
        task = asyncio.create_task(eng.generate(p, Sampling(max_tokens=300, seed=0)))
        await wait_tokens(eng, 5)
        new = perturbed(eng.model)
        await eng.update_weights(StateDict(new), 1)
        out = await asyncio.wait_for(task, 60)
        assert out.versions[0] == 0 and out.versions[-1] == 1 and out.versions == sorted(out.versions)
        for name, param in eng.model.named_parameters():
            assert torch.equal(param, new[name]), name
        after = await eng.generate(p, Sampling(max_tokens=8, seed=1))
        assert set(after.versions) == {1}
        ref = reference_logprobs(eng.model, p, after.ids)
        assert float((ref - torch.tensor(after.logprobs)).abs().max()) < 1e-4
    finally:
        await eng.close()


async def test_update_weights_finish_old_drains_first(tiny_llama_path: str) -> None:
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", stop_on_eos=False, update_mode="finish_old"))
    try:
        p = eng.tokenizer.encode("Once upon a time")
        old = asyncio.create_task(eng.generate(p, Sampling(max_tokens=40, seed=0)))
        await wait_tokens(eng, 3)
        update = asyncio.create_task(eng.update_weights(StateDict(perturbed(eng.model)), 1))
        await asyncio.sleep(0.01)
        newer = asyncio.create_task(eng.generate(p, Sampling(max_tokens=5, seed=1)))
        out_old, _, out_new = await asyncio.wait_for(asyncio.gather(old, update, newer), 60)
        assert set(out_old.versions) == {0} and len(out_old.ids) == 40
        assert set(out_new.versions) == {1}
    finally:
        await eng.close()


async def test_bad_weight_names_and_shapes_are_clear_errors(engine: HFEngine) -> None:
    with pytest.raises(KeyError, match=r"no_such\.weight"):
        await engine.update_weights(StateDict({"no_such.weight": torch.zeros(1)}), 1)
    name, param = next(iter(engine.model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        await engine.update_weights(StateDict({name: torch.zeros(param.shape[0] + 1)}), 1)
    assert engine.policy_version == 0


async def test_cancelled_requests_leave_the_batch_and_close_joins_the_worker(tiny_llama_path: str) -> None:
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", stop_on_eos=False))
    p = eng.tokenizer.encode("Once upon a time")
    victim = asyncio.create_task(eng.generate(p, Sampling(max_tokens=1000)))
    await wait_tokens(eng, 3)
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    ok = await asyncio.wait_for(eng.generate(p, Sampling(max_tokens=4)), 60)
    assert len(ok.ids) == 4
    health = await eng.health()
    assert health.ok and health.in_flight == 0 and 0 < health.busy_fraction <= 1
    pending = asyncio.create_task(eng.generate(p, Sampling(max_tokens=1000)))
    await wait_tokens(eng, eng.tokens_generated + 2)
    worker = eng._worker
    await eng.close()
    with pytest.raises(EngineClosed):
        await asyncio.wait_for(pending, 30)
    assert worker is not None and not worker.is_alive()  # its own worker: other tests' engines may still run
    with pytest.raises(EngineClosed):
        await eng.generate(p, Sampling())


async def test_bf16_autocast_runs(tiny_llama_path: str) -> None:
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", autocast_bf16=True))
    try:
        out = await eng.generate(eng.tokenizer.encode("hi"), Sampling(max_tokens=4, seed=0))
        assert 1 <= len(out.ids) <= 4 and all(lp <= 0 for lp in out.logprobs)
    finally:
        await eng.close()


async def test_cpu_threads_limits_only_the_engine_worker(tiny_llama_path: str) -> None:
    """On a CPU shared with the trainer the engine can take fewer intra-op threads; the caller keeps its own."""
    before = torch.get_num_threads()
    eng = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", cpu_threads=1))
    try:
        await eng.generate(eng.tokenizer.encode("hi"), Sampling(max_tokens=2, seed=0))
        assert (await eng.health()).detail["worker_threads"] == 1
        assert torch.get_num_threads() == before
    finally:
        await eng.close()
