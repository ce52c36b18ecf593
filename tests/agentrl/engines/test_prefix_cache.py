"""Prefix caching in the hf engine: same tokens and logprobs as without it, fewer prefill tokens.

Runs on the tiny random Llama (fp32): greedy outputs and logprobs with the cache
are compared to an engine without it and to a plain forward pass of the full
sequence; hit counts are checked against what the prompts must share.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agentrl.engines.base import Sampling  # noqa: E402
from agentrl.engines.hf import HFEngine  # noqa: E402
from agentrl.engines.prefix_cache import PrefixCache, PrefixEntry  # noqa: E402

pytestmark = pytest.mark.model

GREEDY = Sampling(max_tokens=8, temperature=0.0)


def layer_kv(entry: PrefixEntry, layer: int) -> tuple[Any, Any]:
    """All of an entry's tokens' KV of `layer`, own and inherited, read back through the tree."""
    heads, _, dim = entry.keys[layer].shape
    keys = entry.keys[layer].new_empty((heads, len(entry), dim))
    values = entry.values[layer].new_empty((heads, len(entry), dim))
    entry.copy_into(layer, len(entry), keys, values)
    return keys, values


def make(path: str, cap: int = 32768, **kw: Any) -> HFEngine:
    return HFEngine(
        HFEngine.Config(model=path, dtype="fp32", stop_on_eos=False, prefix_cache_tokens=cap, max_batch_size=8, **kw)
    )


@pytest.fixture
async def pair(tiny_llama_path: str) -> AsyncIterator[tuple[HFEngine, HFEngine]]:
    """(engine with the prefix cache, engine without), same weights."""
    cached, plain = make(tiny_llama_path), make(tiny_llama_path, cap=0)
    yield cached, plain
    await cached.close()
    await plain.close()


def encode(eng: HFEngine, text: str) -> list[int]:
    return list(eng.tokenizer.encode(text))


def forward_logprobs(model: Any, prompt: Sequence[int], ids: Sequence[int]) -> Any:
    """Logprobs of `ids` after `prompt` under one forward pass of the full sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(ids)])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def assert_exact(eng: HFEngine, prompt: list[int], out: Any) -> None:
    ref = forward_logprobs(eng.model, prompt, out.ids)
    assert float((ref - torch.tensor(out.logprobs)).abs().max()) < 1e-4


def assert_same(a: Any, b: Any) -> None:
    assert a.ids == b.ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def detail(eng: HFEngine) -> dict[str, Any]:
    return (await eng.health()).detail


@contextlib.contextmanager
def admitted_together(eng: HFEngine) -> Iterator[None]:
    """Hold admission while requests queue up, so one scheduler step admits them all."""
    with eng._cv:
        eng._paused = True
    try:
        yield
    finally:
        with eng._cv:
            eng._paused = False
            eng._cv.notify()


async def together(eng: HFEngine, prompts: Sequence[list[int]], sampling: Sampling = GREEDY) -> list[Any]:
    with admitted_together(eng):
        tasks = [asyncio.create_task(eng.generate(p, sampling)) for p in prompts]
        async with asyncio.timeout(30):
            while len(eng._waiting) < len(prompts):
                await asyncio.sleep(0.001)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


async def test_multi_turn_chain_reuses_the_previous_turn(pair: tuple[HFEngine, HFEngine]) -> None:
    cached, plain = pair
    prompt = encode(cached, "System: you are a calculator.\nUser: what is 12 + 7?\nAssistant:")
    delta = encode(cached, "\nTool: 19\nAssistant:")
    stored = 0  # tokens of the previous turn's KV in the store: all but its last sampled token
    for _ in range(3):
        before = await detail(cached)
        a = await cached.generate(prompt, GREEDY)
        b = await plain.generate(prompt, GREEDY)
        after = await detail(cached)
        assert_same(a, b)
        assert_exact(cached, prompt, a)
        hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        assert hit == stored
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - hit
        stored = len(prompt) + len(a.ids) - 1
        prompt = prompt + a.ids + delta
    # each turn's entry extends the previous one and stores only its own tokens: the chain's KV is held once
    assert (await detail(cached))["prefix_cache_tokens"] == stored
    # what the run logs as rollout/engine/*: the same counters, and the share of prompt tokens reused
    final, stats = await detail(cached), cached.stats()
    assert stats["prefix_cache_hit_tokens"] == final["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_hit_share"] == final["prefix_cache_hit_tokens"] / (
        final["prefix_cache_hit_tokens"] + final["prefill_tokens"])
    assert plain.stats()["prefix_cache_hit_share"] == 0.0


async def test_requests_admitted_together_with_different_hit_lengths(pair: tuple[HFEngine, HFEngine]) -> None:
    cached, plain = pair
    base = encode(cached, "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide")
    seed = await cached.generate(base, GREEDY)  # leaves base + seed.ids[:-1] in the store
    stored = base + seed.ids[:-1]
    prompts = [
        stored + encode(cached, " and sleep."),  # hit: all of `stored`
        base[:9] + encode(cached, " cat sat on the mat for a long while"),  # hit: 9 tokens
        encode(cached, "Completely unrelated words here"),  # miss
        base,  # a strict prefix of the entry: all but its last token
        stored[:5],  # a short strict prefix: 4 tokens
    ]
    expected = [len(stored), 9, 0, len(base) - 1, 4]
    before = await detail(cached)
    outs = await together(cached, prompts)
    after = await detail(cached)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == sum(expected)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == sum(1 for e in expected if e)
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(map(len, prompts)) - sum(expected)
    refs = await together(plain, prompts)
    for p, out, ref in zip(prompts, outs, refs, strict=True):
        assert_same(out, ref)
        assert_exact(cached, p, out)


async def test_identical_prompts_admitted_together_share_one_prefill(pair: tuple[HFEngine, HFEngine]) -> None:
    cached, plain = pair
    prompt = encode(cached, "A group of samples for one task shares this prompt, word for word, " * 2)
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=3)
    before = await detail(cached)
    outs = await together(cached, [prompt] * 4, sampling)
    after = await detail(cached)
    # the first prefills the prompt; the other three only its last token
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) + 3
    ref = await plain.generate(prompt, sampling)
    for out in outs:
        assert_same(out, ref)  # same seed: same tokens
        assert_exact(cached, prompt, out)


async def test_cached_kv_equals_a_fresh_forward(tiny_llama_path: str) -> None:
    eng = make(tiny_llama_path)
    try:
        shared = "the same long opening words for both prompts, then"
        await together(eng, [encode(eng, "one two three four"), encode(eng, "a much longer prompt with more words in it")])
        await eng.generate(encode(eng, f"{shared} one ending"), GREEDY)
        await eng.generate(encode(eng, f"{shared} a different ending"), GREEDY)  # stores only its own tail
        entries = eng._prefix.entries()
        assert len(entries) == 8  # per request its prompt (at prefill) and its whole row (at retire), chained
        assert any(e.parent is not None and e.base > 5 and e.parent.parent is None for e in entries)
        for entry in entries:
            with torch.no_grad():
                cache = eng.model(entry.tokens[None], use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                keys, values = layer_kv(entry, i)
                assert torch.allclose(layer.keys[0], keys, atol=1e-5)
                assert torch.allclose(layer.values[0], values, atol=1e-5)
    finally:
        await eng.close()


class StateDict:
    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def buckets(self) -> Iterator[list[tuple[str, Any]]]:
        yield list(self.tensors.items())


def perturbed(model: Any, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["continue_new", "finish_old"])
async def test_no_stale_entry_after_a_weight_update(tiny_llama_path: str, mode: str) -> None:
    eng = make(tiny_llama_path, update_mode=mode)
    try:
        prompt = encode(eng, "Once upon a time there was a")
        first = await eng.generate(prompt, GREEDY)
        assert (await detail(eng))["prefix_cache_tokens"] == len(prompt) + len(first.ids) - 1
        # a request running across the update: under continue_new its KV mixes both weights
        running = asyncio.create_task(eng.generate(prompt + first.ids, Sampling(max_tokens=200, seed=0)))
        async with asyncio.timeout(60):
            while eng.tokens_generated < len(first.ids) + 3:
                await asyncio.sleep(0.001)
        await eng.update_weights(StateDict(perturbed(eng.model, 1)), 1)
        spanning = await asyncio.wait_for(running, 60)
        assert set(spanning.versions) == ({0} if mode == "finish_old" else {0, 1})
        # nothing computed under the old weights may serve a new request
        assert (await detail(eng))["prefix_cache_entries"] == 0
        hits = (await detail(eng))["prefix_cache_hit_tokens"]
        again_prompt = prompt + first.ids + spanning.ids
        again = await eng.generate(again_prompt, GREEDY)
        assert (await detail(eng))["prefix_cache_hit_tokens"] == hits
        assert set(again.versions) == {1}
        assert_exact(eng, again_prompt, again)
        # entries made under the new weights are used again
        follow = await eng.generate(again_prompt + again.ids, GREEDY)
        assert (await detail(eng))["prefix_cache_hit_tokens"] == hits + len(again_prompt) + len(again.ids) - 1
        assert_exact(eng, again_prompt + again.ids, follow)
    finally:
        await eng.close()


async def test_eviction_keeps_the_total_under_the_cap(tiny_llama_path: str) -> None:
    cap = 48
    eng = make(tiny_llama_path, cap=cap)
    try:
        words = ["apple", "river", "stone", "cloud", "ember", "frost"]
        for w in words:
            prompt = encode(eng, f"{w} " * 12)
            out = await eng.generate(prompt, GREEDY)
            d = await detail(eng)
            assert d["prefix_cache_tokens"] <= cap
            assert d["prefix_cache_tokens"] == sum(e.own for e in eng._prefix.entries())
            assert_exact(eng, prompt, out)
        assert (await detail(eng))["prefix_cache_evictions"] > 0
        # the most recent entry survived; the oldest did not
        last = encode(eng, f"{words[-1]} " * 12)
        first = encode(eng, f"{words[0]} " * 12)
        entries = eng._prefix.entries()
        assert entries[-1].tokens[: len(last)].tolist() == last
        assert all(e.tokens[: len(first)].tolist() != first for e in entries)
    finally:
        await eng.close()


async def test_cap_zero_disables(tiny_llama_path: str) -> None:
    eng = make(tiny_llama_path, cap=0)
    try:
        prompt = encode(eng, "the same prompt twice")
        a = await eng.generate(prompt, GREEDY)
        b = await eng.generate(prompt + a.ids, GREEDY)
        d = await detail(eng)
        assert d["prefix_cache_hit_tokens"] == 0 and d["prefix_cache_tokens"] == 0
        assert d["prefill_tokens"] == 2 * len(prompt) + len(a.ids)
        assert_exact(eng, prompt + a.ids, b)
    finally:
        await eng.close()
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        HFEngine.Config(prefix_cache_tokens=-1)


def fake_kv(lo: int, hi: int) -> tuple[list[Any], list[Any]]:
    """KV whose keys are the token positions, so what an entry reads back shows where it came from."""
    return [torch.arange(lo, hi, dtype=torch.float32)[None, :, None]], [torch.zeros(1, hi - lo, 1)]


def test_store_deduplicates_truncates_and_matches_only_its_epoch() -> None:
    store = PrefixCache(max_tokens=10)
    store.insert([1, 2, 3], fake_kv, epoch=0)
    store.insert([1, 2], fake_kv, epoch=0)  # covered: nothing new
    assert len(store) == 1 and store.tokens == 3
    store.insert([1, 2, 3, 4, 5], fake_kv, epoch=0)  # extends: stores only 4, 5 and reads 1..3 from [1, 2, 3]
    assert len(store) == 2 and store.tokens == 5
    longest = store.entries()[-2]  # [1, 2, 3] was touched after it: ancestors are more recent
    assert longest.tokens.tolist() == [1, 2, 3, 4, 5] and longest.base == 3 and longest.keys[0].shape == (1, 2, 1)
    assert layer_kv(longest, 0)[0].flatten().tolist() == [0, 1, 2, 3, 4]
    store.insert(list(range(100, 120)), fake_kv, epoch=0)  # longer than the cap: truncated, the rest evicted
    assert store.tokens == 10 and store.evictions == 2
    (entry,) = store.entries()
    assert entry.tokens.tolist() == list(range(100, 110)) and entry.keys[0].shape == (1, 10, 1)
    hit, n = store.lookup(torch.tensor([100, 101, 102, 7]), epoch=0, limit=3)
    assert hit is entry and n == 3
    assert store.lookup(torch.tensor([100, 101, 102, 7]), epoch=0, limit=2)[1] == 2
    assert store.lookup(torch.tensor([100, 101, 102, 7]), epoch=1, limit=3) == (None, 0)
    assert store.lookup(torch.tensor([5, 101]), epoch=0, limit=2) == (None, 0)
    store.clear()
    assert len(store) == 0 and store.tokens == 0


def test_siblings_store_their_shared_prefix_once() -> None:
    store = PrefixCache(max_tokens=1000)
    prompt = list(range(1, 101))  # one prompt, eight samples of it (a GRPO group)
    for k in range(8):
        store.insert([*prompt, 1000 + k, 2000 + k], fake_kv, epoch=0)
    assert store.tokens == 102 + 7 * 2  # the prompt once, then two own tokens per later sample
    for k in range(8):
        hit, n = store.lookup(torch.tensor([*prompt, 1000 + k, 2000 + k, 5]), epoch=0, limit=102)
        assert hit is not None and n == 102 and layer_kv(hit, 0)[0].flatten().tolist() == list(range(102))
    # a sample of another epoch shares nothing, and a sibling links to the entry that owns the prefix
    store.insert([*prompt, 7], fake_kv, epoch=1)
    assert store.tokens == 116 + 101
    owner = next(e for e in store.entries() if e.parent is None and e.epoch == 0)
    assert all(e.parent is owner for e in store.entries() if e.epoch == 0 and e is not owner)


def test_eviction_takes_leaves_first_and_a_parent_takes_its_subtree() -> None:
    store = PrefixCache(max_tokens=30)
    store.insert(list(range(20)), fake_kv, epoch=0)  # the shared prompt
    store.insert([*range(20), 50, 51], fake_kv, epoch=0)
    store.insert([*range(20), 60, 61], fake_kv, epoch=0)
    assert store.tokens == 24
    store.insert(list(range(200, 208)), fake_kv, epoch=0)  # 32 > 30: evicts the LRU leaf [.., 50, 51]
    assert store.evictions == 1 and store.tokens == 30
    left = {tuple(e.tokens.tolist()[-2:]) for e in store.entries()}
    assert (50, 51) not in left and (60, 61) in left and (18, 19) in left
    hit, n = store.lookup(torch.tensor([*range(20), 60, 61]), epoch=0, limit=22)
    assert n == 22 and hit is not None and layer_kv(hit, 0)[0].flatten().tolist() == list(range(22))
    store.drop_epoch(0)
    assert len(store) == 0 and store.tokens == 0


async def test_bf16_autocast_reuses_its_own_kv(tiny_llama_path: str) -> None:
    eng = make(tiny_llama_path, autocast_bf16=True)
    try:
        prompt = encode(eng, "under autocast the cache holds bf16 keys and values")
        a = await eng.generate(prompt, GREEDY)
        b, c = await together(eng, [prompt + a.ids, prompt + a.ids + encode(eng, " more")])
        assert (await detail(eng))["prefix_cache_hit_tokens"] >= 2 * (len(prompt) + len(a.ids) - 1)
        assert b.ids and c.ids and all(lp <= 0 for lp in b.logprobs + c.logprobs)
    finally:
        await eng.close()
