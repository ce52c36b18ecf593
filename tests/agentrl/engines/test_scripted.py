"""The scripted engine: replies, lengths, stops, per-token versions, slots, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pydantic
import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.base import InferenceEngine, Sampling
from agentrl.engines.scripted import Distribution, ScriptedEngine


class ByteTokenizer:
    """Byte-level ids; eos is 256."""

    eos_ids = (256,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class NoBuckets:
    def buckets(self):  # type: ignore[no-untyped-def]
        return iter([[("w", 1.0)]])


async def test_replies_cycle_and_end_with_eos() -> None:
    eng = ScriptedEngine.from_config({"replies": ["ab", "c"]}, tokenizer=ByteTokenizer())
    assert isinstance(eng, InferenceEngine)
    outs = [await eng.generate([1, 2], Sampling(max_tokens=10)) for _ in range(3)]
    assert [o.ids for o in outs] == [[97, 98, 256], [99, 256], [97, 98, 256]]
    assert all(o.finish_reason == "stop" for o in outs)
    assert outs[0].logprobs == [-1.0] * 3 and outs[0].versions == [0, 0, 0]


async def test_reply_fn_sees_the_prompt_text() -> None:
    tok = ByteTokenizer()
    eng = ScriptedEngine(tokenizer=tok, reply_fn=lambda prompt: prompt.upper())
    out = await eng.generate(tok.encode("hi"), Sampling())
    assert out.ids == [*tok.encode("HI"), 256]


async def test_max_tokens_stop_ids_and_stop_strings() -> None:
    tok = ByteTokenizer()
    eng = ScriptedEngine(ScriptedEngine.Config(replies=["hello world"]), tokenizer=tok)
    cut = await eng.generate([0], Sampling(max_tokens=4))
    assert cut.ids == tok.encode("hell") and cut.finish_reason == "length"
    by_id = await eng.generate([0], Sampling(stop_ids=(ord("o"),)))
    assert by_id.ids == tok.encode("hello") and by_id.finish_reason == "stop"
    by_str = await eng.generate([0], Sampling(stop_strings=("lo w",)))
    assert by_str.ids == tok.encode("hello w") and by_str.finish_reason == "stop"


async def test_length_distribution_pads_and_cuts() -> None:
    cfg = ScriptedEngine.Config(replies=["abc"], length=Distribution(kind="fixed", value=6), filler_id=7)
    eng = ScriptedEngine(cfg, tokenizer=ByteTokenizer())
    out = await eng.generate([0], Sampling(max_tokens=100))
    assert out.ids == [97, 98, 99, 7, 7, 7, 256]
    cfg2 = ScriptedEngine.Config(replies=["abcdef"], length=Distribution(kind="uniform", low=1, high=2))
    out2 = await ScriptedEngine(cfg2).generate([0], Sampling(max_tokens=100))
    assert 1 <= len(out2.ids) <= 2 and out2.ids == [97, 98][: len(out2.ids)]


def test_distributions_sample_in_range() -> None:
    import random

    rng = random.Random(0)
    tail = Distribution(kind="lognormal", median=10, sigma=1.5, cap=200)
    xs = [tail.sample(rng) for _ in range(2000)]
    assert max(xs) <= 200 and min(xs) > 0
    assert sorted(xs)[1000] == pytest.approx(10, rel=0.25)  # the median
    assert max(xs) > 5 * 10  # long tail
    with pytest.raises(ValueError, match="low <= high"):
        Distribution(kind="uniform", low=2, high=1).sample(rng)
    with pytest.raises(pydantic.ValidationError, match="kind"):
        Distribution(kind="pareto")  # type: ignore[arg-type]


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(pydantic.ValidationError, match="replys"):
        ScriptedEngine.from_config({"replys": ["x"]})


async def test_versions_change_mid_reply_and_after_updates() -> None:
    cfg = ScriptedEngine.Config(replies=["x" * 500], per_token_s=0.002, append_eos=False)
    eng = ScriptedEngine(cfg)
    task = asyncio.create_task(eng.generate([0], Sampling(max_tokens=1000)))
    while eng._active == 0:  # wait until the reply is being "decoded" (a 1 s window)
        await asyncio.sleep(0)
    await eng.update_weights(NoBuckets(), 3)
    out = await asyncio.wait_for(task, 10)
    assert out.versions[0] == 0 and out.versions[-1] == 3
    assert out.versions == sorted(out.versions)
    assert set(out.versions) == {0, 3}
    later = await eng.generate([0], Sampling())
    assert set(later.versions) == {3}
    assert eng.policy_version == 3


async def test_slots_bound_concurrency_and_busy_fraction_is_a_fraction() -> None:
    cfg = ScriptedEngine.Config(replies=["abcd"], per_token_s=0.001, max_concurrency=2)
    eng = ScriptedEngine(cfg)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, eng._active)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.wait_for(asyncio.gather(*[eng.generate([0], Sampling()) for _ in range(8)]), 10)
    watcher.cancel()
    assert len(outs) == 8 and peak == 2
    health = await eng.health()
    assert 0.0 < health.busy_fraction <= 1.0
    assert health.detail["calls"] == 8


async def test_error_rate_raises_and_close_refuses() -> None:
    eng = ScriptedEngine(ScriptedEngine.Config(error_rate=1.0))
    with pytest.raises(RuntimeError, match="scripted engine failure"):
        await eng.generate([0], Sampling())
    await eng.close()
    assert not (await eng.health()).ok
    with pytest.raises(RuntimeError, match="closed"):
        await eng.generate([0], Sampling())


async def test_named_adapters_tag_their_tokens_with_their_own_version() -> None:
    from agentrl.engines.base import AdapterEngine, AdapterSpec

    eng = ScriptedEngine(ScriptedEngine.Config(replies=["hi"]), tokenizer=SimpleChatTokenizer())
    assert isinstance(eng, AdapterEngine)
    spec = AdapterSpec(4, 8.0, ("q_proj",))
    await eng.update_adapter("alice", _NoWeights(), 3, spec)
    done = await eng.generate([1, 2], Sampling(max_tokens=8, adapter="alice"))
    assert set(done.versions) == {3} and eng.adapter_versions == {"alice": 3}
    assert set((await eng.generate([1, 2], Sampling(max_tokens=8))).versions) == {0}
    with pytest.raises(KeyError, match="bob"):
        await eng.generate([1, 2], Sampling(max_tokens=8, adapter="bob"))
    await eng.remove_adapter("alice")
    with pytest.raises(KeyError, match="alice"):
        await eng.generate([1, 2], Sampling(max_tokens=8, adapter="alice"))


class _NoWeights:
    def buckets(self) -> Any:
        return iter([])
