"""The `ray` engine: N replicas of any engine as Ray actors, behind one InferenceEngine.

Data-parallel generation past one process or one machine: each replica is a
Ray actor that builds an engine plugin (`replica: {name: vllm | hf, params}`)
with the run's model, on the resources Ray gives it (`num_gpus` per replica
places one vLLM engine per GPU across a cluster). Requests are routed by
`PrefixRouter` (agentrl/engines/routing.py): a multi-turn episode's next turn
and a GRPO group's siblings go to the replica whose prefix cache holds their
prefix, unless that replica is overloaded or the others hold as much of it.

Weights reach the replicas by `weight_transport` (see `agentrl.weights.transport`):

- `collective` (what `auto` picks for vLLM replicas): the trainer's rank 0 and
  every vLLM worker of every replica form one process group, and rank 0
  broadcasts the buckets straight into the workers through vLLM's
  weight-transfer API; the pool only orchestrates (rendezvous, ranks,
  version), no byte passes through it or the object store. The group is
  formed at the first sync and formed anew (a fresh rendezvous, every member
  joining again) whenever its membership changes: a gloo or nccl group cannot
  take a new member.
- `object_store` (what `auto` picks for other replicas, e.g. hf): each bucket
  goes into Ray's object store once, and every replica loads them through its
  own engine's `update_weights`.

Either way each replica serves the new weights in place with per-token
versions as its engine gives them; the pool's version moves when all live
replicas serve it.

A replica that dies (its process killed, its node lost) is marked dead: the
request it was serving is sent once more to a live replica (a generate call
has no side effects) and later requests avoid it. In the background the pool
then starts a new replica in its place (up to `max_restarts` times per
replica), loads the weights of the current policy version into it and only
then routes to it again, so a restarted replica never serves stale weights.
With `object_store` the pool keeps the object-store copy of the last update
for this; with `collective` the new replica joins the group at the next sync
and is routed to once that sync has loaded it (the trainer's weights are read
only at syncs, never while a training step changes them). When every replica
is dead, requests wait for a restart (within their deadline) instead of
failing.

A collective sync is run by the weight-sync coordinator
(`agentrl.weights.sync.CollectiveSync`, the pool is its `Fleet`): deadlines
throughout (`update_timeout_s`); a replica that died or hung is named in a
warning and in `health()`, killed and replaced, and the sync runs again over a
new group for the others. Only when no replica could take the weights does
`update_weights` raise (`WeightSyncError`, naming each replica and what
happened to it). The actor shim is `ray_replica._Replica`. Ray is imported
only when the pool is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.engines.base import (
    AdapterSpec,
    BusyClock,
    CheckpointConfig,
    EngineClosed,
    EngineHealth,
    Sampling,
    WeightSource,
)
from agentrl.engines.ray_replica import ReplicaMember, ReplicaSpec, _Replica, cancel
from agentrl.engines.routing import PrefixRouter
from agentrl.registry import Plugins
from agentrl.run.ray_runtime import actor_died, check_resources, require_free, start_or_join
from agentrl.types import Completion
from agentrl.weights.sync import CollectiveSync, Member, resolve_transport
from agentrl.weights.transport import Transport, WeightSyncError, check_transport

__all__ = ["RayEnginePool", "ReplicaDied", "ReplicaSpec"]

log = logging.getLogger(__name__)
_POOL_TRANSPORTS = ("auto", "collective", "object_store")


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
        resources: dict[str, float] = Field(
            default_factory=dict,
            description="custom Ray resources each replica asks for, e.g. {engine_node: 1} with nodes started as "
            "`ray start --resources='{\"engine_node\": 4}'`: replicas land only on the nodes that offer them",
        )
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
        max_restarts: int = Field(
            default=3, ge=0,
            description="times the pool replaces each dead replica with a new one loaded with the current "
            "weights (0 = a dead replica stays dead); needs the last update's weights kept in Ray's object store",
        )
        restart_backoff_s: float = Field(
            default=5.0, ge=0, description="seconds between two attempts to restart the same replica"
        )
        weight_transport: Transport = Field(
            default="auto",
            description="how trainer weights reach the replicas: collective (the trainer's rank 0 broadcasts "
            "into every vLLM worker over one process group, vLLM's weight-transfer API), object_store (Ray's "
            "object store, any replica engine), auto (collective for vllm replicas, else object_store)",
        )

        @field_validator("resources")
        @classmethod
        def _resources(cls, value: dict[str, float]) -> dict[str, float]:
            return check_resources(value, key="engine.resources")

        @field_validator("weight_transport")
        @classmethod
        def _transport(cls, value: str) -> str:
            return check_transport(value, key="engine.weight_transport", allowed=_POOL_TRANSPORTS)

        @model_validator(mode="after")
        def _collective_needs_vllm(self) -> RayEnginePool.Config:
            if self.weight_transport == "collective" and self.replica.name != "vllm":
                raise ValueError(
                    f"engine.weight_transport=collective needs vllm replicas (engine.replica.name="
                    f"{self.replica.name!r} cannot join vLLM's weight transfer); use object_store or auto"
                )
            return self

    def __init__(self, config: RayEnginePool.Config | None = None, *, plugins: Plugins | None = None) -> None:
        """Start the replicas; `plugins` is the run's registry (default: installed plugins) for `replica.name`."""
        self.config = cfg = config if config is not None else self.Config()
        registry = plugins if plugins is not None else Plugins.discover()
        engine_cls = registry.registry("engines").get(cfg.replica.name)
        import ray

        self._own_ray = start_or_join(cfg.address, cfg.replicas * cfg.num_cpus)
        try:
            require_free(cfg.address, {"CPU": cfg.replicas * cfg.num_cpus, "GPU": cfg.replicas * cfg.num_gpus},
                         f"engine.replicas={cfg.replicas} of {{CPU: {cfg.num_cpus}, GPU: {cfg.num_gpus}}}")  # fmt: skip
        except BaseException:
            if self._own_ray:
                ray.shutdown()
            raise
        params = dict(cfg.replica.params)
        fields = engine_cls.Config.model_fields
        if "model" in fields:
            params["model"] = cfg.model
        if "dtype" in fields:
            params.setdefault("dtype", cfg.dtype)
        if "update_timeout_s" in fields:  # a replica's part of a sync has the pool's deadline
            params.setdefault("update_timeout_s", cfg.update_timeout_s)
        self._actor = ray.remote(
            num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, resources=cfg.resources or None, max_restarts=0
        )(_Replica)
        self._engine_cls, self._params = engine_cls, params
        self._replicas = [self._new_replica() for _ in range(cfg.replicas)]
        self._router = PrefixRouter(
            cfg.replicas, block_tokens=cfg.block_tokens, max_imbalance=cfg.max_imbalance,
            min_gain_tokens=cfg.min_gain_tokens, affinity=cfg.routing == "prefix",
        )  # fmt: skip
        self.policy_version = 0
        self.retried = 0  # requests sent again after their replica died
        self.restarted = 0  # dead replicas replaced by a new one that serves the current weights
        self.syncs = {"collective": 0, "object_store": 0}  # weight updates done, per transport
        self._attempts = [0] * cfg.replicas  # restart attempts per replica
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self._weights: list[Any] = []  # object refs of the last update's buckets (kept for restarts)
        self._nodes: list[str] = []  # the Ray node of each replica
        self._busy = [BusyClock() for _ in range(cfg.replicas)]  # per replica: time with a request of ours there
        self._update_lock: asyncio.Lock | None = None
        # the collective transport (agentrl.weights.sync) and the replacements waiting for its next sync
        self._sync = CollectiveSync(self, timeout_s=cfg.update_timeout_s, on_gpu=cfg.num_gpus > 0,
                                    otherwise="object_store", size=cfg.replicas)  # fmt: skip
        self._awaiting: dict[int, asyncio.Future[None]] = {}
        # what the replicas' engines serve beyond the model: grammars, LoRA adapters (vllm replicas)
        self.constrained_decoding = bool(getattr(engine_cls, "constrained_decoding", False))
        self.weights_wanted = "full"  # "adapter": syncs carry a LoRA trainer's adapter alone (share_base_with)
        self._policy_spec: AdapterSpec | None = None
        self._adapters: dict[str, tuple[list[Any], int, AdapterSpec]] = {}  # name -> (refs, version, spec)
        self._closed = False
        try:
            # a replica's first call returns once its engine is built (or raises what building it raised)
            self._nodes = ray.get([r.node.remote() for r in self._replicas], timeout=cfg.start_timeout_s)
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
        if sampling.adapter is not None and sampling.adapter not in self._adapters:
            raise KeyError(f"adapter {sampling.adapter!r} is not held by the ray pool; it holds: "
                           f"{sorted(self._adapters) or 'none'}")  # fmt: skip
        prompt = list(prompt_ids)
        async with asyncio.timeout(self.config.request_timeout_s):
            while True:
                await self._until_a_replica_lives()
                replica = self._router.choose(prompt)
                self._busy[replica].enter()
                served: list[int] | None = None
                handle = self._replicas[replica]
                ref = handle.generate.remote(prompt, sampling)
                try:
                    completion: Completion = await ref
                    served = prompt + completion.ids
                    return completion
                except asyncio.CancelledError:
                    cancel(ref)
                    raise
                except BaseException as e:
                    if not actor_died(e):
                        raise
                    self._lost(replica, handle, e)
                    self.retried += 1  # a generate call has no side effects: serve it elsewhere
                finally:
                    self._router.release(replica, served)
                    self._busy[replica].leave()

    def transport_for(self, weights: WeightSource) -> str:
        """The transport the pool uses for `weights` (`weight_transport`, with `auto` resolved)."""
        vllm = self.config.replica.name == "vllm"
        return resolve_transport(self.config.weight_transport, weights, collective_ok=vllm, remote_only=False,
                                 otherwise="object_store")  # fmt: skip

    @property
    def sync_failures(self) -> list[str]:
        """What went wrong in collective syncs, one line per replica failure (run-long)."""
        return self._sync.failures

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Every live replica (and each replacement waiting for weights) loads `weights`, then serves `version`."""
        if self._closed:
            raise EngineClosed("ray engine pool is closed")
        if self.transport_for(weights) == "collective":
            await self._collective_update(weights, version)
            self.syncs["collective"] += 1
            return
        await self._object_store_update(weights, version)
        self.syncs["object_store"] += 1

    async def _object_store_update(self, weights: WeightSource, version: int) -> None:
        """Put each bucket into the object store once; every live replica loads them all."""
        import ray

        async with asyncio.timeout(self.config.update_timeout_s), self._updating():
            refs = await asyncio.to_thread(lambda: [ray.put(list(bucket)) for bucket in weights.buckets()])
            live = [(i, self._replicas[i]) for i, ok in enumerate(self._router.alive) if ok]
            results = await asyncio.gather(
                *(handle.update_weights.remote(refs, version) for _, handle in live), return_exceptions=True
            )
            for (i, handle), result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    if not actor_died(result):
                        raise result
                    self._lost(i, handle, result)
            # a replica restarting now loads these (under this lock), so none serves older weights
            self._weights = refs if self.config.max_restarts else []
            self.policy_version = version
            if not any(self._router.alive) and not self._restarting:
                raise ReplicaDied("every engine replica is dead")

    # -- LoRA: adapter-only syncs and named adapters (vllm replicas started with lora_rank) ---------------

    def share_base_with(self, trainer: object) -> bool:
        """Have every replica take a LoRA trainer's adapter alone at each sync (see `VLLMEngine.share_base_with`);
        True when all of them will. Replicas started later (restarts) take them too."""
        from agentrl.trainer import AdapterTrainer

        spec_of = getattr(trainer, "adapter_spec", None)
        if not isinstance(trainer, AdapterTrainer) or not callable(spec_of):
            return False
        spec = spec_of()
        if not isinstance(spec, AdapterSpec):
            return False
        import ray

        taken = ray.get([r.take_adapter_syncs.remote(spec) for r in self._replicas], timeout=self.config.start_timeout_s)
        if not all(taken):
            if any(taken):
                raise RuntimeError("some replicas take adapter-only syncs and others do not (engine.replica.params)")
            return False
        self._policy_spec, self.weights_wanted = spec, "adapter"
        return True

    @property
    def adapter_versions(self) -> dict[str, int]:
        """The version of each named adapter every live replica holds (`AdapterEngine`)."""
        return {name: version for name, (_, version, _) in self._adapters.items()}

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None:
        """Every live replica adds or replaces adapter `name` (its tensors through Ray's object store once:
        an adapter is small); a replica restarted later loads the kept copy before it serves."""
        import ray

        if self._closed:
            raise EngineClosed("ray engine pool is closed")
        async with asyncio.timeout(self.config.update_timeout_s), self._updating():
            refs = await asyncio.to_thread(lambda: [ray.put(list(bucket)) for bucket in weights.buckets()])
            await self._on_live(lambda handle: handle.update_adapter.remote(name, refs, version, spec))
            self._adapters[name] = (refs, version, spec)

    async def remove_adapter(self, name: str) -> None:
        """Every live replica frees adapter `name`."""
        if name not in self._adapters:
            raise KeyError(f"adapter {name!r} is not held by the ray pool; it holds: {sorted(self._adapters)}")
        async with asyncio.timeout(self.config.update_timeout_s), self._updating():
            del self._adapters[name]
            await self._on_live(lambda handle: handle.remove_adapter.remote(name))

    async def _on_live(self, call: Any) -> None:
        """`call(handle)` on every live replica at once; one that died is handled as in `generate`."""
        live = [(i, self._replicas[i]) for i, ok in enumerate(self._router.alive) if ok]
        results = await asyncio.gather(*(call(handle) for _, handle in live), return_exceptions=True)
        for (i, handle), result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                if not actor_died(result):
                    raise result
                self._lost(i, handle, result)

    async def _restore_lora(self, handle: Any) -> None:
        """A new replica takes what the others hold: adapter-only syncs, and every named adapter."""
        if self._policy_spec is not None and not await handle.take_adapter_syncs.remote(self._policy_spec):
            raise RuntimeError("the new replica cannot take adapter-only syncs")
        for name, (refs, version, spec) in list(self._adapters.items()):
            await handle.update_adapter.remote(name, refs, version, spec)

    # -- the collective transport -------------------------------------------------------------

    async def _collective_update(self, weights: WeightSource, version: int) -> None:
        """Broadcast `weights` from the trainer's rank 0 into every target replica; replace the ones that fail.

        Targets are the live replicas and the replacements waiting for weights
        (`agentrl.weights.sync.CollectiveSync` runs the sync and its retry).
        """
        async with self._updating():
            await self._sync.update(weights, version)
            self.policy_version = version

    # the coordinator's view of the pool (agentrl.weights.sync.Fleet)

    async def targets(self) -> list[int]:
        """The replicas to sync; when none is live but some restart, wait (update_timeout_s) for one to be built."""
        deadline = asyncio.get_running_loop().time() + self.config.update_timeout_s
        while not self._targets() and self._restarting and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        return self._targets()

    def _targets(self) -> list[int]:
        return [i for i, ok in enumerate(self._router.alive) if ok] + sorted(self._awaiting)

    def member(self, index: int) -> Member:
        return ReplicaMember(self._replicas[index])

    def describe(self, index: int) -> str:
        return f"engine replica {index} (node {self._node_of(index)})"

    def lost(self, index: int, member: Member, line: str) -> None:
        """Kill a replica that died or hung during a sync and replace it (a failed replacement tries again)."""
        import ray

        handle = member.handle if isinstance(member, ReplicaMember) else self._replicas[index]
        with contextlib.suppress(Exception):
            ray.kill(handle)  # a hung replica holds its resources until killed
        if index in self._awaiting:  # a replacement that failed its first load: its restart tries again
            waiting = self._awaiting.pop(index)
            if not waiting.done():
                waiting.set_exception(WeightSyncError(line))
        else:
            self._lost(index, handle, WeightSyncError(line))

    def hold(self, index: int) -> None:
        if self._router.alive[index]:
            self._router.mark_dead(index)
            self._awaiting.setdefault(index, asyncio.get_running_loop().create_future())

    def synced(self, targets: list[int]) -> None:
        for i in targets:
            self._router.revive(i)
            waiting = self._awaiting.pop(i, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    def _node_of(self, replica: int) -> str:
        return self._nodes[replica] if replica < len(self._nodes) else "?"

    def busy_seconds(self) -> float:
        """Mean over replicas of the time each had a request in flight (what `rollout/engine_busy` reads)."""
        return sum(clock.seconds() for clock in self._busy) / len(self._busy)

    def stats(self) -> dict[str, float]:
        """Replica counters for the run's metrics (`rollout/engine/<key>`); cheap, no remote calls."""
        router = self._router
        return {
            "replicas": float(len(router.alive)),
            "replicas_alive": float(sum(router.alive)),
            "replicas_restarting": float(len(self._restarting)),
            "replica_restarts": float(self.restarted),
            "retried_requests": float(self.retried),
            "weight_sync_failures": float(len(self.sync_failures)),
            "collective_syncs": float(self.syncs["collective"]),
            "object_store_syncs": float(self.syncs["object_store"]),
        }

    async def health(self) -> EngineHealth:
        """Asks every live replica; one found dead here is handled as in `generate` (routed around, restarted)."""
        live = [(i, self._replicas[i]) for i, ok in enumerate(self._router.alive) if ok]
        reports = await asyncio.gather(*(handle.health.remote() for _, handle in live), return_exceptions=True)
        for (i, handle), report in zip(live, reports, strict=True):
            if isinstance(report, BaseException) and actor_died(report):
                self._lost(i, handle, report)
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
                "replicas_restarting": sorted(self._restarting),
                "replica_restarts": self.restarted,
                "routed_by_prefix": router.by_prefix,
                "routed_by_load": router.by_load,
                "retried_on_dead_replica": self.retried,
                "requests_per_replica": list(router.routed),
                "replica_nodes": list(self._nodes),
                "replicas_awaiting_weights": sorted(self._awaiting),
                "weight_sync_failures": list(self.sync_failures[-10:]),
            },
        )

    # -- dead replicas ----------------------------------------------------------------------

    def _new_replica(self) -> Any:
        return self._actor.remote(self._engine_cls, self._params)

    def _updating(self) -> asyncio.Lock:
        """The lock that orders weight updates and restarted replicas' first load."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def _lost(self, replica: int, handle: Any, exc: BaseException) -> None:
        """`handle`, serving as `replica`, died: route around it and start its replacement if allowed."""
        if self._replicas[replica] is not handle or not self._router.alive[replica]:
            return  # already known, or `replica` already runs a new actor
        self._router.mark_dead(replica)
        log.warning("engine replica %d died: %s", replica, exc)
        if not self._closed and self._attempts[replica] < self.config.max_restarts:
            task = asyncio.create_task(self._restart(replica), name=f"agentrl-ray-restart-{replica}")
            self._restarting[replica] = task
            task.add_done_callback(functools.partial(self._restart_ended, replica))

    def _restart_ended(self, replica: int, task: asyncio.Task[None]) -> None:
        if self._restarting.get(replica) is task:  # not a later restart of the same replica
            del self._restarting[replica]

    async def _restart(self, replica: int) -> None:
        """Replace a dead replica: start a new actor, load the current weights, then route to it again."""
        import ray

        cfg = self.config
        while self._attempts[replica] < cfg.max_restarts and not self._closed:
            self._attempts[replica] += 1
            with contextlib.suppress(Exception):
                ray.kill(self._replicas[replica])
            handle = self._replicas[replica] = self._new_replica()
            try:
                async with asyncio.timeout(cfg.start_timeout_s):
                    self._nodes[replica] = await handle.node.remote()  # returns once its engine is built
                async with asyncio.timeout(cfg.update_timeout_s), self._updating():
                    await self._restore_lora(handle)
                if self._sync.used:  # the next sync forms a new group with it and loads it
                    waiting = self._awaiting[replica] = asyncio.get_running_loop().create_future()
                    await waiting
                else:
                    async with asyncio.timeout(cfg.update_timeout_s), self._updating():
                        if self._weights:
                            await handle.update_weights.remote(self._weights, self.policy_version)
                        self._router.revive(replica)
                self.restarted += 1
                log.warning("engine replica %d restarted (attempt %d) at policy version %d",
                            replica, self._attempts[replica], self.policy_version)  # fmt: skip
                return
            except Exception as e:  # it did not start or load: try again after a pause
                log.warning("restarting engine replica %d failed (attempt %d of %d): %s",
                            replica, self._attempts[replica], cfg.max_restarts, e)  # fmt: skip
                await asyncio.sleep(cfg.restart_backoff_s)

    async def _until_a_replica_lives(self) -> None:
        """Return when some replica is alive; wait for restarts when none is; ReplicaDied when none will be."""
        while not any(self._router.alive):
            waits: list[asyncio.Future[Any]] = [*self._restarting.values(), *self._awaiting.values()]
            if not waits:
                raise ReplicaDied("every engine replica is dead and none is being restarted")
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    async def close(self) -> None:
        """Close every live replica's engine, then end the actors (and the local Ray this pool started)."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._restarting.values()):
            task.cancel()
        import ray

        await self._sync.close()  # the replicas close all the same when the trainer's end fails to
        live = [self._replicas[i] for i, ok in enumerate(self._router.alive) if ok] if ray.is_initialized() else []
        try:
            async with asyncio.timeout(self.config.update_timeout_s):
                await asyncio.gather(*(r.close.remote() for r in live), return_exceptions=True)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        if not ray.is_initialized():  # whoever started Ray shut it down already: the replicas went with it
            return
        for replica in self._replicas:
            ray.kill(replica)
        if self._own_ray:
            ray.shutdown()

    async def __aenter__(self) -> RayEnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
