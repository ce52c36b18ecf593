"""The `ray` engine: two hf replicas of a tiny random Llama as Ray actors on a local Ray.

One pool serves the module (Ray and two model processes take a while to
start); the tests that kill replicas run last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from engine_reference import load_model, max_diff, reference_logprobs, train_on_engine

from agentrl.engines.base import Sampling

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray]

PROMPT = [1, 28, 300, 4000, 17, 9, 44, 45, 46, 47, 48, 49]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tiny_llama_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec

    engine = RayEnginePool(
        RayEnginePool.Config(
            model=tiny_llama_path, dtype="fp32", replicas=2, num_cpus=1, block_tokens=4, min_gain_tokens=8,
            replica=ReplicaSpec(name="hf", params={"cpu_threads": 1}),
        )
    )  # fmt: skip
    yield engine
    await engine.close()


async def _routed(pool: Any) -> list[int]:
    return list((await pool.health()).detail["requests_per_replica"])


@pytest.mark.asyncio(loop_scope="module")
async def test_replicas_serve_exact_logprobs_and_share_the_load(pool: Any, tiny_llama_path: str) -> None:
    model = load_model(tiny_llama_path)
    prompts = [[1, 60 + i, 70 + i, 80 + i, 90 + i] for i in range(8)]
    outs = await asyncio.gather(*(pool.generate(p, Sampling(max_tokens=12, seed=i)) for i, p in enumerate(prompts)))
    assert max(max_diff(o.logprobs, reference_logprobs(model, p, o.ids)) for o, p in zip(outs, prompts, strict=True)) < 1e-4
    assert all(o.versions == [0] * len(o.ids) for o in outs)
    per_replica = await _routed(pool)
    assert min(per_replica) >= 2, f"one replica did (almost) all the work: {per_replica}"
    health = await pool.health()
    assert health.ok and health.detail["replicas_alive"] == 2 and health.in_flight == 0
    assert pool.busy_seconds() > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_the_next_turn_goes_to_the_replica_holding_the_conversation(pool: Any) -> None:
    before = await _routed(pool)
    first = await pool.generate(PROMPT, Sampling(max_tokens=8, seed=1))
    after_first = await _routed(pool)
    served = [i for i in range(2) if after_first[i] > before[i]]
    assert len(served) == 1
    # keep the other replica busy-free and the same one loaded: affinity, not load, decides
    conversation = PROMPT + first.ids + [5, 6, 7, 8]
    for turn in range(3):
        out = await pool.generate(conversation, Sampling(max_tokens=8, seed=turn))
        conversation = conversation + out.ids + [5, 6, 7, 8]
    final = await _routed(pool)
    assert final[served[0]] == after_first[served[0]] + 3
    assert final[1 - served[0]] == after_first[1 - served[0]]
    assert (await pool.health()).detail["routed_by_prefix"] >= 3


@pytest.mark.asyncio(loop_scope="module")
async def test_a_weight_update_reaches_every_replica(pool: Any, tiny_llama_path: str) -> None:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    new = load_model(tiny_llama_path, seed=3)
    await pool.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(new), bucket_mb=0.2), 1)
    assert pool.policy_version == 1
    for replica in pool._replicas:  # each replica on its own, not whichever the router picks
        out = await replica.generate.remote(PROMPT, Sampling(max_tokens=12, seed=5))
        assert out.versions == [1] * 12
        assert max_diff(out.logprobs, reference_logprobs(new, PROMPT, out.ids)) < 1e-4
    assert (await pool.health()).policy_version == 1


async def _until(check: Any, timeout_s: float = 180.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.2)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_dead_replica_is_routed_around_then_restarted_with_the_current_weights(
    pool: Any, tiny_llama_path: str
) -> None:
    import ray

    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    current = load_model(tiny_llama_path, seed=4)
    version = pool.policy_version + 1
    syncs_before = pool.stats()["object_store_syncs"]
    await pool.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(current), bucket_mb=0.2), version)
    # the conversation's replica dies: its next turn is retried on the other one
    first = await pool.generate(PROMPT, Sampling(max_tokens=4, seed=1))
    [owner] = pool._router.holders(PROMPT + first.ids)
    dead = pool._replicas[owner]
    ray.kill(dead)
    outs = await asyncio.gather(*(pool.generate(PROMPT + first.ids, Sampling(max_tokens=4, seed=i)) for i in range(4)))
    assert all(len(o.ids) == 4 and o.versions == [version] * 4 for o in outs)
    assert pool.retried >= 1 and pool._router.alive[owner] is False
    # a new replica takes its place, loaded with the weights of the current version before it serves
    await _until(lambda: pool.restarted == 1)
    replacement = pool._replicas[owner]
    assert replacement is not dead and pool._router.alive[owner]
    out = await replacement.generate.remote(PROMPT, Sampling(max_tokens=12, seed=5))
    assert out.versions == [version] * 12
    assert max_diff(out.logprobs, reference_logprobs(current, PROMPT, out.ids)) < 1e-4
    health = await pool.health()
    assert health.ok and health.detail["replicas_alive"] == 2 and health.detail["replica_restarts"] == 1
    assert pool.stats() == {"replicas": 2.0, "replicas_alive": 2.0, "replicas_restarting": 0.0, "replica_restarts": 1.0,
                            "retried_requests": float(pool.retried), "weight_sync_failures": 0.0,
                            "collective_syncs": 0.0, "object_store_syncs": syncs_before + 1}  # fmt: skip


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lone_replica_that_dies_is_waited_for_until_its_restarts_run_out(pool: Any, tiny_llama_path: str) -> None:
    """One replica, one restart: the first death costs a wait, not the request; the second is final.

    num_cpus=0: the module's pool holds the CPUs Ray was started with.
    """
    import ray

    from agentrl.engines.ray_pool import RayEnginePool, ReplicaDied, ReplicaSpec

    lone = RayEnginePool(
        RayEnginePool.Config(
            model=tiny_llama_path, dtype="fp32", replicas=1, num_cpus=0, max_restarts=1, restart_backoff_s=0,
            replica=ReplicaSpec(name="hf", params={"cpu_threads": 1}),
        )
    )  # fmt: skip
    try:
        ray.kill(lone._replicas[0])
        out = await lone.generate(PROMPT, Sampling(max_tokens=6, seed=2))  # waits for the restart
        assert len(out.ids) == 6 and lone.restarted == 1 and lone.retried == 1
        ray.kill(lone._replicas[0])
        with pytest.raises(ReplicaDied, match="none is being restarted"):
            await lone.generate(PROMPT, Sampling(max_tokens=6, seed=2))
        assert not (await lone.health()).ok and lone.stats()["replicas_alive"] == 0
    finally:
        await lone.close()


def test_agentrl_train_on_a_ray_pool(tmp_path: Path, tiny_llama_path: str) -> None:
    """The whole loop with two replicas: every step's weights reach both (mismatch stays at rounding level)."""
    steps = train_on_engine(tmp_path, tiny_llama_path, "{name: ray, dtype: fp32, replicas: 2, num_cpus: 1, block_tokens: 16}", steps=2)
    mismatch = [r["off_policy/mismatch_kl"] for r in steps]
    print(f"ray pool, 2 steps: off_policy/mismatch_kl per step = {mismatch}")
    assert all(0 <= m < 1e-6 for m in mismatch), mismatch
    assert all(r["rollout/engine/replicas_alive"] == 2 and r["rollout/engine/replica_restarts"] == 0 for r in steps)
