"""The rollout loop on a real (tiny random) model: the trainer's recomputed logprobs match."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")

from agentrl.chat.conversation import HFChatTokenizer  # noqa: E402
from agentrl.engines.hf import HFEngine  # noqa: E402
from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig  # noqa: E402
from agentrl.rollout.config import RolloutConfig, SamplingConfig  # noqa: E402
from agentrl.rollout.manager import RolloutManager  # noqa: E402

pytestmark = pytest.mark.model


async def test_multi_turn_trajectories_match_a_forward_pass(tiny_llama_path: str) -> None:
    tok = HFChatTokenizer.from_pretrained(tiny_llama_path)
    engine = HFEngine.from_config({"model": tiny_llama_path, "dtype": "fp32", "max_batch_size": 8}, tokenizer=tok)
    cfg = RolloutConfig(group_size=2, groups_per_step=2, max_in_flight=4, max_turns=3, max_new_tokens_per_turn=12,
                        max_total_tokens=512, sampling=SamplingConfig(temperature=0.9, top_k=40))
    env_factory = lambda: TrivialEnv(TrivialEnvConfig(turns=3))  # noqa: E731
    work = [{"id": f"t{i}", "prompt": f"Count to {i + 3}."} for i in range(2)]
    try:
        async with RolloutManager(env_factory, work, engine, tok, cfg) as manager:
            async with asyncio.timeout(120):
                groups = [g async for g in manager.groups()]
        assert len(groups) == 2
        worst = 0.0
        for traj in (t for g in groups for t in g.trajectories):
            assert traj.error is None and len(traj.turns) == 3 and traj.terminated
            sample = traj.tokens()
            with torch.no_grad():
                logits = engine.model(torch.tensor([sample.input_ids])).logits[0].float()
            for turn in traj.turns:  # the engine's distribution: temperature 0.9, top-k 40
                span = logits[turn.start - 1 : turn.end - 1] / 0.9
                kth = span.topk(40, dim=-1).values[:, -1:]
                logp = span.masked_fill(span < kth, float("-inf")).log_softmax(-1)
                ids = torch.tensor(sample.input_ids[turn.start : turn.end])
                ref = logp.gather(1, ids[:, None]).squeeze(1)
                got = torch.tensor(sample.behaviour_logprobs[turn.start : turn.end])
                worst = max(worst, float((ref - got).abs().max()))
                assert set(sample.loss_mask[turn.start : turn.end]) == {1}
        print(f"max |rollout logprob - trainer-side forward logprob| over 4 multi-turn episodes = {worst:.3g}")
        assert worst < 1e-4
    finally:
        await engine.close()


async def test_cancelling_a_manager_releases_engine_requests(tiny_llama_path: str) -> None:
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", stop_on_eos=False))
    tok = HFChatTokenizer(engine.tokenizer)
    cfg = RolloutConfig(group_size=4, max_in_flight=8, max_new_tokens_per_turn=400, max_total_tokens=2048)
    work = [{"id": f"t{i}", "prompt": "Tell a long story."} for i in range(8)]
    before = asyncio.all_tasks()
    async with RolloutManager(lambda: TrivialEnv(), work, engine, tok, cfg):
        async with asyncio.timeout(60):
            while engine.tokens_generated < 20:
                await asyncio.sleep(0.01)
    assert asyncio.all_tasks() == before
    async with asyncio.timeout(60):  # the worker drops the cancelled rows at its next step
        while (await engine.health()).in_flight:
            await asyncio.sleep(0.01)
    worker = engine._worker
    assert worker is not None and worker.name == "agentrl-hf-engine"
    await engine.close()
    assert not worker.is_alive() and worker not in threading.enumerate()  # this engine's thread (not another test's)
