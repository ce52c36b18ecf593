"""Several named LoRA adapters over one base in the hf engine (tiny random Llama).

The reference for every logprob is a transformers forward pass of a peft
model holding that adapter alone (base + adapter, unmerged), under the same
temperature / top-k / top-p (`engine_reference.reference_logprobs`). Adapter
"a" (rank 4, four modules) and "b" (rank 8, all seven) differ in shape, so the
per-layer stacks hold adapters of different ranks and targets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine_reference import load_model, lora_model, max_diff, reference_logprobs  # noqa: E402

from agentrl.engines.base import AdapterEngine, AdapterSpec, Sampling, canonical_adapter_name  # noqa: E402
from agentrl.engines.hf import HFEngine  # noqa: E402

pytestmark = pytest.mark.model

SPEC_A = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
SPEC_B = AdapterSpec(rank=8, alpha=4.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"))  # fmt: skip
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.8, top_k=30), dict(temperature=1.2, top_p=0.9)]


class Adapter:
    """A peft model's adapter tensors under canonical names, in small buckets (as `sync_policies` sends them)."""

    def __init__(self, model: Any, edit: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]] | None = None):
        named = [(canonical_adapter_name(n), p.detach().clone()) for n, p in model.named_parameters() if "lora_" in n]
        self.named = edit(named) if edit else named

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        for i in range(0, len(self.named), 5):
            yield self.named[i : i + 5]


@pytest.fixture(scope="module")
def models(tiny_llama_path: str) -> dict[str, Any]:
    return {
        "base": load_model(tiny_llama_path),
        "a": lora_model(tiny_llama_path, SPEC_A.rank, SPEC_A.alpha, SPEC_A.target_modules, seed=1),
        "b": lora_model(tiny_llama_path, SPEC_B.rank, SPEC_B.alpha, SPEC_B.target_modules, seed=2),
        "a2": lora_model(tiny_llama_path, SPEC_A.rank, SPEC_A.alpha, SPEC_A.target_modules, seed=3),
    }


def _engine(path: str, prefix_cache_tokens: int = 0) -> HFEngine:
    """No prefix cache unless asked: a hit changes rounding (~1e-6), and some tests compare outputs exactly."""
    return HFEngine(HFEngine.Config(model=path, dtype="fp32", max_batch_size=16, stop_on_eos=False,
                                    prefix_cache_tokens=prefix_cache_tokens))  # fmt: skip


async def _with_ab(eng: HFEngine, models: dict[str, Any]) -> None:
    await eng.update_adapter("a", Adapter(models["a"]), 3, SPEC_A)
    await eng.update_adapter("b", Adapter(models["b"]), 7, SPEC_B)


def _prompt(eng: HFEngine, text: str = "The quick brown fox jumps over") -> list[int]:
    return list(eng.tokenizer.encode(text))


def _ref(models: dict[str, Any], name: str | None, prompt: list[int], ids: list[int], kw: dict[str, Any]) -> Any:
    model = models["base" if name is None else name]
    t = kw.get("temperature", 1.0) or 1.0  # greedy: the plain distribution's logprob
    return reference_logprobs(model, prompt, ids, t, kw.get("top_k", 0), kw.get("top_p", 1.0))


async def test_each_request_samples_with_the_adapter_it_names(tiny_llama_path: str, models: dict[str, Any]) -> None:
    eng = _engine(tiny_llama_path)
    try:
        assert isinstance(eng, AdapterEngine)
        await _with_ab(eng, models)
        assert eng.adapter_versions == {"a": 3, "b": 7}
        prompt = _prompt(eng)
        cases = [(name, kw) for name in ["a", "b", None] for kw in SAMPLINGS]
        outs = await asyncio.wait_for(asyncio.gather(*(
            eng.generate(prompt, Sampling(max_tokens=12, seed=i, adapter=name, **kw))  # type: ignore[arg-type]
            for i, (name, kw) in enumerate(cases))), 120)  # fmt: skip
        for (name, kw), out in zip(cases, outs, strict=True):
            diff = max_diff(out.logprobs, _ref(models, name, prompt, out.ids, kw))
            assert diff < 1e-4, (name, kw, diff)
            assert out.versions == [{"a": 3, "b": 7, None: 0}[name]] * 12
            other = {"a": "b", "b": "a", None: "a"}[name]
            assert max_diff(out.logprobs, _ref(models, other, prompt, out.ids, kw)) > 1e-2  # told apart
            if kw["temperature"] == 0:  # greedy: the peft model's own greedy continuation
                model = models["base" if name is None else name]
                with torch.no_grad():
                    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
                assert out.ids == ref[0, len(prompt) :].tolist(), name
    finally:
        await eng.close()


async def test_a_mixed_batch_gives_each_request_what_it_gets_alone(
    tiny_llama_path: str, models: dict[str, Any]
) -> None:
    eng, plain = _engine(tiny_llama_path), _engine(tiny_llama_path)
    try:
        await _with_ab(eng, models)
        texts = ["Hello there, how", "1 2 3 4", "def f(x):\n    return", "Once upon a time"]
        cases = [(name, _prompt(eng, texts[i % 4]), Sampling(max_tokens=10, seed=i, temperature=1.0, adapter=name))
                 for i, name in enumerate(["a", "b", None, "a", None, "b"])]  # fmt: skip
        alone = [await eng.generate(p, s) for _, p, s in cases]
        steps = eng.steps
        together = await asyncio.wait_for(asyncio.gather(*(eng.generate(p, s) for _, p, s in cases)), 120)
        assert eng.steps - steps <= 10  # one batch: a prefill and 9 decode steps for all six
        for (name, _, _), one, mixed in zip(cases, alone, together, strict=True):
            assert mixed.ids == one.ids, name
            assert max_diff(mixed.logprobs, one.logprobs) < 1e-5, name
            assert mixed.versions == one.versions
        # the base path with adapters held is exactly the engine without any
        for (name, p, s), one in zip(cases, alone, strict=True):
            if name is None:
                ref = await plain.generate(p, s)
                assert (ref.ids, ref.logprobs) == (one.ids, one.logprobs)
    finally:
        await eng.close()
        await plain.close()


async def test_an_update_changes_only_its_adapter_and_versions_follow(
    tiny_llama_path: str, models: dict[str, Any]
) -> None:
    eng = _engine(tiny_llama_path)
    try:
        await _with_ab(eng, models)
        prompt = _prompt(eng)
        before_b = await eng.generate(prompt, Sampling(max_tokens=8, seed=5, adapter="b"))
        await eng.update_adapter("a", Adapter(models["a2"]), 4, SPEC_A)  # replaced in place
        assert eng.adapter_versions == {"a": 4, "b": 7}
        out_a = await eng.generate(prompt, Sampling(max_tokens=8, seed=6, adapter="a"))
        assert out_a.versions == [4] * 8
        assert max_diff(out_a.logprobs, _ref(models, "a2", prompt, out_a.ids, {})) < 1e-4
        after_b = await eng.generate(prompt, Sampling(max_tokens=8, seed=5, adapter="b"))
        assert (after_b.ids, after_b.logprobs, after_b.versions) == (before_b.ids, before_b.logprobs, before_b.versions)

        # continue_new: a running request's later tokens carry the new version; "b" beside it keeps its own
        start = eng.tokens_generated
        long_a = asyncio.create_task(eng.generate(prompt, Sampling(max_tokens=60, seed=7, adapter="a")))
        long_b = asyncio.create_task(eng.generate(prompt, Sampling(max_tokens=60, seed=8, adapter="b")))
        async with asyncio.timeout(60):
            while eng.tokens_generated < start + 20:
                await asyncio.sleep(0.001)
        await eng.update_adapter("a", Adapter(models["a"]), 5, SPEC_A)
        out_a, out_b = await asyncio.wait_for(asyncio.gather(long_a, long_b), 60)
        assert out_a.versions[0] == 4 and out_a.versions[-1] == 5 and out_a.versions == sorted(out_a.versions)
        assert out_b.versions == [7] * 60
    finally:
        await eng.close()


async def test_unknown_adapters_and_bad_tensors_are_clear_errors(tiny_llama_path: str, models: dict[str, Any]) -> None:
    eng = _engine(tiny_llama_path)
    try:
        await _with_ab(eng, models)
        prompt = _prompt(eng)
        with pytest.raises(KeyError, match=r"'c' is not held by this hf engine; it holds: \['a', 'b'\]"):
            await eng.generate(prompt, Sampling(max_tokens=4, adapter="c"))
        before = await eng.generate(prompt, Sampling(max_tokens=6, seed=1, adapter="a"))

        def drop_one(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            return named[1:]

        def add_one(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            return [*named, ("model.layers.0.mlp.gate_proj.lora_A.weight", named[0][1])]

        with pytest.raises(ValueError, match=r"missing \(1\): model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight"):
            await eng.update_adapter("a", Adapter(models["a2"], drop_one), 9, SPEC_A)
        with pytest.raises(ValueError, match=r"unexpected \(1\): model\.layers\.0\.mlp\.gate_proj\.lora_A\.weight"):
            await eng.update_adapter("a", Adapter(models["a2"], add_one), 9, SPEC_A)
        wrong_rank = AdapterSpec(8, 8.0, SPEC_A.target_modules)
        with pytest.raises(ValueError, match=r"mis-shaped \(16\): model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight "
                                             r"\[4, 64\] \(spec wants \[8, 64\]\)"):  # fmt: skip
            await eng.update_adapter("a", Adapter(models["a2"]), 9, wrong_rank)
        with pytest.raises(ValueError, match="match no linear layer"):
            await eng.update_adapter("c", Adapter(models["a2"]), 9, AdapterSpec(4, 8.0, ("no_such_proj",)))
        assert eng.adapter_versions == {"a": 3, "b": 7}  # a failed update changes nothing
        again = await eng.generate(prompt, Sampling(max_tokens=6, seed=1, adapter="a"))
        assert (again.ids, again.logprobs) == (before.ids, before.logprobs)
    finally:
        await eng.close()


async def test_the_prefix_cache_never_serves_kv_across_adapters(tiny_llama_path: str, models: dict[str, Any]) -> None:
    eng = _engine(tiny_llama_path, prefix_cache_tokens=4096)
    try:
        await _with_ab(eng, models)
        prompt = _prompt(eng, "A long shared system prompt that every agent of the episode sees, " * 3)

        async def run(name: str | None, ref: str | None = None) -> int:
            hits = eng.prefix_hits
            out = await eng.generate(prompt, Sampling(max_tokens=6, seed=2, adapter=name))
            assert max_diff(out.logprobs, _ref(models, ref or name, prompt, out.ids, {})) < 1e-4, name
            return eng.prefix_hits - hits

        assert await run("a") == 0
        assert await run("b") == 0  # the same prompt under another adapter: computed afresh
        assert await run(None) == 0
        assert await run("a") == 1 and await run("b") == 1 and await run(None) == 1  # each reuses its own
        await eng.update_adapter("a", Adapter(models["a2"]), 4, SPEC_A)
        assert await run("a", "a2") == 0  # its KV went with its old tensors
        assert await run("b") == 1  # the others' stayed
    finally:
        await eng.close()


async def test_remove_frees_an_adapter_after_its_requests(tiny_llama_path: str, models: dict[str, Any]) -> None:
    eng = _engine(tiny_llama_path)
    try:
        await eng.update_adapter("a", Adapter(models["a"]), 3, SPEC_A)
        only_a = eng.memory_stats()["adapters_mb"]
        await eng.update_adapter("b", Adapter(models["b"]), 7, SPEC_B)
        assert eng.memory_stats()["adapters_mb"] > only_a > 0
        prompt = _prompt(eng)
        running = asyncio.create_task(eng.generate(prompt, Sampling(max_tokens=40, seed=3, adapter="b")))
        async with asyncio.timeout(60):
            while eng.tokens_generated < 3:
                await asyncio.sleep(0.001)
        removal = asyncio.create_task(eng.remove_adapter("b"))
        await asyncio.sleep(0)
        with pytest.raises(KeyError, match=r"'b' is not held .* it holds: \['a'\]"):
            await eng.generate(prompt, Sampling(max_tokens=4, adapter="b"))  # refused at once
        out = await asyncio.wait_for(running, 60)  # the running one finishes with its adapter
        assert out.versions == [7] * 40 and max_diff(out.logprobs, _ref(models, "b", prompt, out.ids, {})) < 1e-4
        await asyncio.wait_for(removal, 60)
        assert eng.adapter_versions == {"a": 3}
        assert eng.memory_stats()["adapters_mb"] == pytest.approx(only_a)
        await eng.remove_adapter("a")
        assert eng.adapter_versions == {} and eng.memory_stats()["adapters_mb"] == 0
        with pytest.raises(KeyError, match="it holds: none"):
            await eng.remove_adapter("a")
        await eng.update_adapter("b", Adapter(models["b"]), 8, SPEC_B)  # added again: served afresh
        out = await eng.generate(prompt, Sampling(max_tokens=6, seed=4, adapter="b"))
        assert out.versions == [8] * 6 and max_diff(out.logprobs, _ref(models, "b", prompt, out.ids, {})) < 1e-4
    finally:
        await eng.close()


async def test_named_adapters_over_the_trainers_shared_base(tiny_llama_path: str, models: dict[str, Any]) -> None:
    """Beside a LoRA trainer the engine's base is the trainer's frozen tensors and adapter None is the
    trainer's own adapter; a named adapter sits on the frozen base alone."""
    from agentrl.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer({"lora": {"r": 4, "alpha": 8}}, tiny_llama_path)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)  # the trainer's adapter differs from the base
    eng = _engine(tiny_llama_path)
    try:
        assert eng.share_base_with(trainer)
        await _with_ab(eng, models)
        prompt = _prompt(eng)
        names = ["a", None, "b", None]
        outs = await asyncio.wait_for(asyncio.gather(*(
            eng.generate(prompt, Sampling(max_tokens=8, seed=i, adapter=n)) for i, n in enumerate(names))), 120)
        for name, out in zip(names, outs, strict=True):
            model = trainer.model if name is None else models[name]
            assert max_diff(out.logprobs, reference_logprobs(model, prompt, out.ids)) < 1e-4, name
    finally:
        await eng.close()
