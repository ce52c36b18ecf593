"""The `ray` engine on a multi-node Ray cluster: replicas on separate nodes, a node lost and replaced.

Ray's own `cluster_utils.Cluster` runs several Ray nodes (a raylet each) on
this one machine. The head has no CPU for actors, each worker node one, so
each replica must land on a node of its own; the pool joins the cluster by
`address`, like `address: auto` on a real cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from engine_reference import load_model, max_diff, reference_logprobs

from agentrl.engines.base import Sampling

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray]

PROMPT = [1, 28, 300, 4000, 17, 9, 44, 45, 46, 47, 48, 49]


@pytest.fixture
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another test module's local Ray
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


async def _exact_on_each(pool: Any, model: Any, version: int) -> None:
    for replica in pool._replicas:
        out = await replica.generate.remote(PROMPT, Sampling(max_tokens=10, seed=3))
        assert out.versions == [version] * 10
        assert max_diff(out.logprobs, reference_logprobs(model, PROMPT, out.ids)) < 1e-4


@pytest.mark.asyncio
async def test_replicas_spread_over_nodes_and_a_lost_node_is_replaced(cluster: Any, tiny_llama_path: str) -> None:
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    first, second = cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    pool = RayEnginePool(
        RayEnginePool.Config(
            model=tiny_llama_path, dtype="fp32", replicas=2, num_cpus=1, address=cluster.address,
            restart_backoff_s=1.0, replica=ReplicaSpec(name="hf", params={"cpu_threads": 1}),
        )
    )  # fmt: skip
    try:
        nodes = (await pool.health()).detail["replica_nodes"]
        assert sorted(nodes) == sorted([first.node_id, second.node_id])
        trained = load_model(tiny_llama_path, seed=7)
        await pool.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(trained), bucket_mb=0.2), 1)
        await _exact_on_each(pool, trained, 1)

        # a node is lost; a fresh node joins: the lost replica comes back there, with version 1's weights
        third = cluster.add_node(num_cpus=1)
        cluster.remove_node(first)
        outs = await asyncio.gather(*(pool.generate(PROMPT, Sampling(max_tokens=4, seed=i)) for i in range(6)))
        assert all(o.versions == [1] * 4 for o in outs)  # served throughout, by the surviving replica
        async with asyncio.timeout(180):
            while pool.restarted < 1:
                await pool.health()  # a replica that died idle is found here too
                await asyncio.sleep(0.5)
        health = await pool.health()
        assert health.ok and health.detail["replicas_alive"] == 2
        assert sorted(health.detail["replica_nodes"]) == sorted([second.node_id, third.node_id])
        await _exact_on_each(pool, trained, 1)
    finally:
        await pool.close()
