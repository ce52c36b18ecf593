"""One replica of the `ray` pool (`ray_pool.RayEnginePool`): the Ray actor, its spec, and its part in a sync.

- `ReplicaSpec`: the engine plugin each replica runs, and its params.
- `_Replica`: the actor shim (its name is the actors' process title,
  `ray::_Replica`); it builds that engine in the actor's process and
  forwards the engine contract (generate, update_weights, health) and the
  collective transport's calls (join / receive / leave a weight-transfer
  group) to it.
- `ReplicaMember`: a replica's actor handle as a member of the weight-sync
  coordinator's group (`agentrl.weights.sync.Member`): each remote call under
  a deadline, a dead actor recognised as such.

Ray is imported only inside the calls that need it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, field_validator

from agentrl.engines.base import AdapterEngine, AdapterSpec, EngineHealth, Sampling
from agentrl.registry import PluginRef
from agentrl.run.ray_runtime import actor_died
from agentrl.types import JSON, Completion
from agentrl.weights.transport import WeightSyncError


class ReplicaSpec(PluginRef):
    """The engine plugin each replica runs, and its params (model and dtype come from the pool)."""

    kind: ClassVar[str] = "engines"
    name: str = Field(default="hf", description="engine plugin of each replica, e.g. hf or vllm")
    params: dict[str, JSON] = Field(default_factory=dict, description="options of that engine (its Config)")

    @field_validator("name")
    @classmethod
    def _not_a_pool(cls, name: str) -> str:
        if name == "ray":
            raise ValueError("a ray replica cannot itself be a ray pool")
        return name


class _Replica:
    """The Ray actor: one engine, built in the actor's process; async methods run on its event loop."""

    def __init__(self, engine_cls: Any, params: dict[str, Any]) -> None:
        self.engine = engine_cls.from_config(engine_cls.Config(**params))

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        completion: Completion = await self.engine.generate(prompt_ids, sampling)
        return completion

    async def update_weights(self, bucket_refs: list[Any], version: int) -> None:
        buckets = [await ref for ref in bucket_refs]  # fetched without blocking this actor's event loop
        await self.engine.update_weights(FetchedBuckets(buckets), version)

    async def health(self) -> EngineHealth:
        health: EngineHealth = await self.engine.health()
        return health

    # LoRA (a vllm engine started with lora_rank): adapter-only syncs and named adapters

    def take_adapter_syncs(self, spec: AdapterSpec) -> bool:
        take = getattr(self.engine, "take_adapter_syncs", None)
        return bool(take(spec)) if take is not None else False

    async def update_adapter(self, name: str, bucket_refs: list[Any], version: int, spec: AdapterSpec) -> None:
        if not isinstance(self.engine, AdapterEngine):
            raise RuntimeError(f"engine {type(self.engine).__name__} holds no named adapters")
        buckets = [await ref for ref in bucket_refs]
        await self.engine.update_adapter(name, FetchedBuckets(buckets), version, spec)

    async def remove_adapter(self, name: str) -> None:
        if isinstance(self.engine, AdapterEngine):
            await self.engine.remove_adapter(name)

    # the collective transport (a vllm engine): this replica's workers in the trainer's weight-transfer group

    def weight_workers(self) -> int:
        return int(self._collective().weight_workers())

    def serving_dtype(self) -> str:
        return str(self._collective().serving_dtype())

    async def join_weight_group(self, init_info: dict[str, Any]) -> None:
        await self._collective().join_weight_group(init_info)

    async def receive_weights(self, version: int, bare_bytes: int = 0, bare_chunk: int = 1 << 28) -> None:
        await self._collective().receive_weights(version, bare_bytes=bare_bytes, bare_chunk=bare_chunk)

    async def leave_weight_group(self) -> None:
        await self._collective().leave_weight_group()

    async def ping(self) -> bool:
        """True when the engine answers (its model process included, where it has one)."""
        ping = getattr(self.engine, "ping", None)
        return bool(await ping()) if ping is not None else True

    def _collective(self) -> Any:
        if not hasattr(self.engine, "join_weight_group"):
            raise WeightSyncError(f"engine {type(self.engine).__name__} cannot join a weight-transfer group")
        return self.engine

    def node(self) -> str:
        """The Ray node this replica runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def close(self) -> None:
        await self.engine.close()


class FetchedBuckets:
    """A WeightSource over buckets already fetched from Ray's object store."""

    def __init__(self, buckets: list[Sequence[tuple[str, Any]]]) -> None:
        self._buckets = buckets

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        yield from self._buckets


@dataclass(frozen=True, eq=True)
class ReplicaMember:
    """A replica's actor handle as a member of a weight-transfer group (`agentrl.weights.sync.Member`)."""

    handle: Any

    async def weight_workers(self, timeout_s: float) -> int:
        return int(await within(self.handle.weight_workers.remote(), timeout_s))

    async def serving_dtype(self, timeout_s: float) -> str:
        return str(await within(self.handle.serving_dtype.remote(), timeout_s))

    async def join(self, init_info: dict[str, Any], timeout_s: float) -> None:
        await within(self.handle.join_weight_group.remote(init_info), timeout_s)

    async def receive(self, version: int, timeout_s: float) -> None:
        await within(self.handle.receive_weights.remote(version), timeout_s)

    async def leave(self, timeout_s: float) -> None:
        await within(self.handle.leave_weight_group.remote(), timeout_s)

    async def ping(self, timeout_s: float) -> bool:
        return bool(await within(self.handle.ping.remote(), timeout_s))

    def died(self, exc: BaseException) -> bool:
        return actor_died(exc)


async def within(ref: Any, timeout_s: float) -> Any:
    """A remote call's result, or TimeoutError after `timeout_s` (the call is cancelled)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await ref
    except TimeoutError:
        cancel(ref)
        raise


def cancel(ref: Any) -> None:
    """Cancel a remote call (best effort: the task may have finished, or its actor died)."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref)
