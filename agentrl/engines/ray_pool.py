"""The `ray` engine: N replicas of any engine as Ray actors, behind one InferenceEngine.

Data-parallel generation past one process or one machine: each replica is a
Ray actor that builds an engine plugin (`replica: {name: vllm | hf, params}`)
with the run's model, on the resources Ray gives it (`num_gpus` per replica
places one vLLM engine per GPU across a cluster). Requests are routed by
`PrefixRouter` (agentrl/engines/routing.py): a multi-turn episode's next turn
and a GRPO group's siblings go to the replica whose prefix cache holds their
prefix, unless that replica is overloaded or the others hold as much of it.

Weight updates put each bucket of the trainer's tensors into Ray's object
store once, and every replica loads them through its own engine's
`update_weights` (in place, per-token versions as that engine gives them);
the pool's version moves when all replicas serve it.

A replica that dies (its process killed, its node lost) is marked dead: the
request it was serving is sent once more to a live replica (a generate call
has no side effects), later requests avoid it, and `health()` reports it.
Ray is imported only when the pool is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from agentrl.engines.base import (
    BusyClock,
    CheckpointConfig,
    EngineClosed,
    EngineHealth,
    Sampling,
    WeightSource,
)
from agentrl.engines.routing import PrefixRouter
from agentrl.registry import Plugins, PluginSpec
from agentrl.types import JSON, Completion


class ReplicaSpec(PluginSpec):
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
        await self.engine.update_weights(_Buckets(buckets), version)

    async def health(self) -> EngineHealth:
        health: EngineHealth = await self.engine.health()
        return health

    async def close(self) -> None:
        await self.engine.close()


class _Buckets:
    """A WeightSource over buckets already fetched from Ray's object store."""

    def __init__(self, buckets: list[Sequence[tuple[str, Any]]]) -> None:
        self._buckets = buckets

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        yield from self._buckets


class ReplicaDied(EngineClosed):
    """Every replica of the pool is dead (or the last one died while serving the request)."""


class RayEnginePool:
    """Engine replicas as Ray actors with prefix-affinity routing and object-store weight broadcast."""

    class Config(CheckpointConfig):
        replicas: int = Field(default=2, ge=1, description="engine replicas (Ray actors)")
        replica: ReplicaSpec = Field(default_factory=ReplicaSpec, description="the engine each replica runs")
        address: str | None = Field(
            default=None,
            description="Ray cluster to join ('auto' = the one `ray start` made here, or ray://host:port); "
            "None = start a local Ray for this run",
        )
        num_cpus: float = Field(default=1.0, ge=0, description="CPUs Ray reserves for each replica")
        num_gpus: float = Field(default=0.0, ge=0, description="GPUs Ray reserves for each replica")
        routing: Literal["prefix", "least_loaded"] = Field(
            default="prefix",
            description="prefix: a request goes to the replica that served its longest prefix (prefix-cache "
            "reuse across turns and group members); least_loaded: fewest requests in flight",
        )
        block_tokens: int = Field(default=16, ge=1, description="prefix routing granularity in tokens (vLLM caches 16-token blocks)")
        min_gain_tokens: int = Field(
            default=32, ge=0,
            description="prefix routing picks the replica holding the deepest prefix only if it holds this many "
            "more tokens of the request than the least loaded replica",
        )
        max_imbalance: int = Field(
            default=8, ge=1,
            description="prefix routing yields to the least loaded replica when the prefix's replica has this "
            "many more requests in flight",
        )
        start_timeout_s: float = Field(default=900.0, gt=0, description="seconds for all replicas to start")
        request_timeout_s: float = Field(
            default=600.0, gt=0, description="seconds a generate call may wait for its completion"
        )
        update_timeout_s: float = Field(default=600.0, gt=0, description="seconds per update_weights call")

    def __init__(self, config: RayEnginePool.Config | None = None, *, plugins: Plugins | None = None) -> None:
        """Start the replicas; `plugins` is the run's registry (default: installed plugins) for `replica.name`."""
        self.config = cfg = config if config is not None else self.Config()
        registry = plugins if plugins is not None else Plugins.discover()
        engine_cls = registry.registry("engines").get(cfg.replica.name)
        import ray

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            local = cfg.address is None
            ray.init(
                address=cfg.address,
                num_cpus=max(os.cpu_count() or 1, math.ceil(cfg.replicas * cfg.num_cpus)) if local else None,
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
            )
        params = dict(cfg.replica.params)
        fields = engine_cls.Config.model_fields
        if "model" in fields:
            params["model"] = cfg.model
        if "dtype" in fields:
            params.setdefault("dtype", cfg.dtype)
        actor = ray.remote(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, max_restarts=0)(_Replica)
        self._replicas = [actor.remote(engine_cls, params) for _ in range(cfg.replicas)]
        self._router = PrefixRouter(
            cfg.replicas, block_tokens=cfg.block_tokens, max_imbalance=cfg.max_imbalance,
            min_gain_tokens=cfg.min_gain_tokens, affinity=cfg.routing == "prefix",
        )  # fmt: skip
        self.policy_version = 0
        self.retried = 0
        self._busy = [BusyClock() for _ in range(cfg.replicas)]  # per replica: time with a request of ours there
        self._update_lock: asyncio.Lock | None = None
        self._closed = False
        try:
            ray.get([r.health.remote() for r in self._replicas], timeout=cfg.start_timeout_s)
        except BaseException:
            self._shutdown()
            raise

    @classmethod
    def from_config(
        cls, config: RayEnginePool.Config | dict[str, Any], *, tokenizer: Any = None, plugins: Plugins | None = None
    ) -> RayEnginePool:
        """Build from a config; each replica detokenizes with its own engine's tokenizer."""
        return cls(config if isinstance(config, cls.Config) else cls.Config.model_validate(config), plugins=plugins)

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        if self._closed:
            raise EngineClosed("ray engine pool is closed")
        prompt = list(prompt_ids)
        async with asyncio.timeout(self.config.request_timeout_s):
            while True:
                replica = self._router.choose(prompt)
                self._busy[replica].enter()
                served: list[int] | None = None
                ref = self._replicas[replica].generate.remote(prompt, sampling)
                try:
                    completion: Completion = await ref
                    served = prompt + completion.ids
                    return completion
                except asyncio.CancelledError:
                    _cancel(ref)
                    raise
                except BaseException as e:
                    if not _actor_died(e):
                        raise
                    self._router.mark_dead(replica)
                    if not any(self._router.alive):
                        raise ReplicaDied(f"every engine replica is dead (the last: {e})") from e
                    self.retried += 1  # a generate call has no side effects: serve it elsewhere
                finally:
                    self._router.release(replica, served)
                    self._busy[replica].leave()

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Put each bucket into the object store once; every live replica loads them all."""
        import ray

        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with asyncio.timeout(self.config.update_timeout_s), self._update_lock:
            refs = await asyncio.to_thread(lambda: [ray.put(list(bucket)) for bucket in weights.buckets()])
            live = [i for i, ok in enumerate(self._router.alive) if ok]
            results = await asyncio.gather(
                *(self._replicas[i].update_weights.remote(refs, version) for i in live), return_exceptions=True
            )
            for i, result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    if not _actor_died(result):
                        raise result
                    self._router.mark_dead(i)
            if not any(self._router.alive):
                raise ReplicaDied("every engine replica is dead")
            self.policy_version = version

    def busy_seconds(self) -> float:
        """Mean over replicas of the time each had a request in flight (what `rollout/engine_busy` reads)."""
        return sum(clock.seconds() for clock in self._busy) / len(self._busy)

    async def health(self) -> EngineHealth:
        live = [i for i, ok in enumerate(self._router.alive) if ok]
        reports = await asyncio.gather(*(self._replicas[i].health.remote() for i in live), return_exceptions=True)
        healthy = [r for r in reports if isinstance(r, EngineHealth)]
        router = self._router
        return EngineHealth(
            ok=not self._closed and len(healthy) == len(router.alive) and all(h.ok for h in healthy),
            policy_version=self.policy_version,
            in_flight=sum(router.in_flight),
            busy_fraction=sum(h.busy_fraction for h in healthy) / len(healthy) if healthy else 0.0,
            detail={
                "replicas": len(router.alive),
                "replicas_alive": sum(router.alive),
                "routed_by_prefix": router.by_prefix,
                "routed_by_load": router.by_load,
                "retried_on_dead_replica": self.retried,
                "requests_per_replica": list(router.routed),
            },
        )

    async def close(self) -> None:
        """Close every live replica's engine, then end the actors (and the local Ray this pool started)."""
        if self._closed:
            return
        self._closed = True
        live = [self._replicas[i] for i, ok in enumerate(self._router.alive) if ok]
        try:
            async with asyncio.timeout(self.config.update_timeout_s):
                await asyncio.gather(*(r.close.remote() for r in live), return_exceptions=True)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        for replica in self._replicas:
            ray.kill(replica)
        if self._own_ray:
            ray.shutdown()

    async def __aenter__(self) -> RayEnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _actor_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, ActorDiedError | ActorUnavailableError | RayActorError)


def _cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # the task may have finished, or its actor died
        ray.cancel(ref)
