"""How trainer weights reach engines: the `weight_transport` setting and the collective path's contract.

Four transports, chosen per engine plugin (`engine.weight_transport`):

- `collective`: the OpenRLHF way. The trainer's rank 0 and every worker of
  every vLLM engine form one process group (gloo on CPUs, a backend this
  package registers with vLLM's `WeightTransferEngineFactory` as
  `agentrl_gloo`; see `gloo_backend`), and the trainer broadcasts the
  weights bucket by bucket straight into the workers through vLLM's
  weight-transfer API (`init_weight_transfer_engine`, `start_weight_update`,
  `update_weights`, `finish_weight_update`). The driver only orchestrates: it
  never holds a byte of the weights (unless it is itself the trainer's rank 0).
- `shm`: one `vllm` engine colocated with the trainer's process writes each
  bucket to /dev/shm and its workers read them back (today's single-machine path).
- `object_store`: a `ray` pool puts each bucket into Ray's object store once
  and every replica fetches them (any replica engine, hf included).
- `auto`: `collective` as soon as the trainer and the engine are in different
  processes or nodes (a `ray` pool of vLLM replicas, or a `ray` trainer group
  with a `vllm` engine), else `shm` (a `vllm` engine) or `object_store`
  (a pool of non-vLLM replicas).

Weight sources that can broadcast themselves (`NamedTensorBuckets` in the
trainer's own process, the `ray` trainer group's rank 0) offer
`weight_sender()`: the trainer-side end of the group, kept by the engine (or
pool) that orchestrates the group for the rest of the run.

Kept free of torch and vLLM imports: vLLM loads `register_vllm_backend` in every
one of its processes through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from agentrl.engines.base import WeightSource

Transport = Literal["auto", "collective", "shm", "object_store"]
TRANSPORTS: tuple[str, ...] = ("auto", "collective", "shm", "object_store")
VLLM_BACKEND = "agentrl_gloo"  # the name our backend is registered under in vLLM's factory
T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """A collective weight sync failed: an engine died, hung past its deadline, or the group broke."""


def check_transport(value: str, *, key: str, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of `allowed`, else a ValueError naming the key, the value and what is allowed."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed here; use one of: {', '.join(allowed)}")
    return value


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where a weight-transfer group meets and who is in it (the trainer's rank 0 is group rank 0)."""

    host: str
    port: int
    world_size: int  # 1 (the trainer) + every worker of every engine
    timeout_s: float  # every collective of the group (gloo's own timeout) and its rendezvous
    backend: str = "gloo"  # the torch.distributed backend of the group: gloo (CPUs) or nccl (GPUs)

    def worker_init(self, rank_offset: int) -> dict[str, Any]:
        """The `init_info` of vLLM's `init_weight_transfer_engine` for an engine whose first worker is `rank_offset`."""
        return {
            "master_address": self.host, "master_port": self.port, "rank_offset": rank_offset,
            "world_size": self.world_size, "timeout_s": self.timeout_s, "group_backend": self.backend,
        }  # fmt: skip


@runtime_checkable
class WeightSender(Protocol):
    """The trainer's rank 0 in a weight-transfer group (in this process, or a Ray actor's).

    `connect` blocks until every member has joined; `send` broadcasts one
    source's buckets (cast to `dtype`, a torch dtype name) and returns what it
    sent (`bytes`, `buckets`, `seconds`, `peak_buffer_bytes`). Every call has
    a deadline: the group's own collective timeout, and `timeout_s` here.
    """

    local: bool  # True when rank 0 is this process (the trainer is colocated with the driver)
    device: str  # where rank 0 holds the weights it sends: "cpu" or "cuda"

    async def rendezvous(self) -> tuple[str, int]: ...

    async def connect(self, spec: GroupSpec) -> None: ...

    async def send(self, source: WeightSource, dtype: str, timeout_s: float) -> dict[str, float]: ...

    async def close(self) -> None: ...


def group_backend(sender_device: str, engines_on_gpu: bool) -> str:
    """The group's torch.distributed backend: nccl when both ends hold their weights on GPUs, else gloo.

    With gloo a GPU end stages each bucket through host memory (the trainer
    packs it on the CPU; a worker copies what it received to its device).
    """
    return "nccl" if sender_device == "cuda" and engines_on_gpu else "gloo"


def sender_of(source: WeightSource) -> WeightSender | None:
    """The sender a weight source offers (`source.weight_sender()`), or None when it cannot broadcast itself."""
    make = getattr(source, "weight_sender", None)
    if not callable(make):
        return None
    sender = make()
    return sender if isinstance(sender, WeightSender) else None


async def together(*calls: Awaitable[T]) -> list[T]:
    """Run the two ends of a collective at once; the first failure cancels the others and is raised as is.

    (A sender whose receivers failed would otherwise wait out the group's timeout.)
    """
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def register_vllm_backend() -> None:
    """Register the gloo weight-transfer backend with vLLM's factory (lazily imported; safe to call twice).

    vLLM calls this in each of its processes (driver, engine core, workers)
    through the `vllm.general_plugins` entry point of this package, before a
    worker builds its weight-transfer engine.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if VLLM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            VLLM_BACKEND, "agentrl.weights.gloo_backend", "GlooWeightTransferEngine"
        )


def vllm_backend_installed() -> str | None:
    """None when vLLM's processes will find our backend; else why not (an actionable message)."""
    import os
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("agentrl.")}
    if not names:
        return (
            "the 'vllm.general_plugins' entry point of agentrl is not installed (reinstall agentrl: "
            "pip install -e .), so vLLM's workers cannot load the agentrl_gloo weight-transfer backend"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and not names & set(allowed.split(",")):
        return f"VLLM_PLUGINS={allowed!r} leaves out agentrl's plugin ({', '.join(sorted(names))}); add it"
    return None
