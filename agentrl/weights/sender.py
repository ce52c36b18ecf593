"""The trainer's rank 0 in a weight-transfer group: broadcasts its weights, bucket by bucket, into vLLM's workers.

The other end is vLLM's weight-transfer API with the `agentrl_gloo` backend
(`agentrl.weights.gloo_backend`); the engine or pool that owns the
engines orchestrates both ends (`agentrl.weights.transport`). Here:

- `WeightBroadcaster`: the group's rank 0 in this process. It hosts the
  rendezvous, packs each bucket of the trainer's tensors into one wire buffer
  (cast to the engines' dtype on the way) and broadcasts it while the next
  bucket is packed: at most two buckets of extra memory. ZeRO-3 and FSDP
  trainers gather each tensor as their weight source yields it, so gathering
  is per bucket too.
- `LocalWeightSender`: the async `WeightSender` over a broadcaster in this
  process (an in-process `torch` trainer); blocking calls run in a thread,
  each under a deadline.
- `RankZeroSender` and `rank_call`: the same for a trainer whose rank 0
  is a Ray actor (the `ray` trainer group): the driver sends only the calls,
  the bytes go from that actor straight to the workers. Under FSDP the other
  ranks iterate the weights along (each tensor is gathered from all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from agentrl.engines.base import WeightSource
from agentrl.weights import wire
from agentrl.weights.transport import GroupSpec


class WeightBroadcaster:
    """Rank 0 of one weight-transfer group (blocking calls; one group at a time)."""

    def __init__(self) -> None:
        self._store: Any = None
        self._group: Any = None
        self._spec: GroupSpec | None = None

    @staticmethod
    def rendezvous(host: str | None = None) -> tuple[str, int]:
        """Where a new group can meet: this node's address (Ray's view of it when Ray runs) and a free port."""
        if host is None:
            host = _node_address()
        return host, wire.free_port(host)

    def connect(self, spec: GroupSpec) -> None:
        """Host the rendezvous and wait until all `spec.world_size` members have joined (or spec.timeout_s)."""
        self.close()
        self._store, self._group = wire.open_group(
            spec.host, spec.port, 0, spec.world_size, spec.timeout_s, spec.backend
        )
        self._spec = spec

    @property
    def connected(self) -> bool:
        return self._group is not None

    def send(
        self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], dtype: torch.dtype | None,
        bucket_bytes: int = 256 << 20,
    ) -> dict[str, float]:
        """Broadcast every bucket, then the end of the stream; returns bytes, buckets, seconds, peak buffer bytes.

        Wire buffers in flight stay under 2 * `bucket_bytes` (or one oversized bucket alone); big tensors that
        need no cast are sent from the trainer's own memory and count for nothing.
        """
        group, spec = self._require()
        limit = 2 * bucket_bytes
        device = _device(spec.backend)
        started = time.perf_counter()
        sent = count = peak = 0
        in_flight: wire.InFlight | None = None
        in_flight_bytes = 0
        try:
            for bucket in buckets:
                if in_flight is not None and in_flight_bytes + wire.packed_size(bucket, dtype, device) > limit:
                    in_flight.wait()  # an oversized bucket is packed only once the last one is off the wire
                    in_flight, in_flight_bytes = None, 0
                meta, payload, direct = wire.pack(bucket, dtype, device)
                peak = max(peak, in_flight_bytes + payload.numel())  # this bucket packed, the last one on the wire
                if in_flight is not None:
                    in_flight.wait()
                in_flight = wire.send_bucket(group, meta, payload, direct, spec.timeout_s)
                in_flight_bytes = payload.numel()
                sent += payload.numel() + sum(d.numel() for d in direct)
                count += 1
                del payload, direct
            if in_flight is not None:
                in_flight.wait()
            wire.send_end(group, device, spec.timeout_s)
        except BaseException:
            self.close()  # a broken group cannot be reused: the next sync forms a new one
            raise
        return {"bytes": float(sent), "buckets": float(count), "seconds": time.perf_counter() - started,
                "peak_buffer_bytes": float(peak)}  # fmt: skip

    def send_bare(self, nbytes: int, bucket_bytes: int) -> dict[str, float]:
        """Broadcast `nbytes` of zeros in `bucket_bytes` pieces, nothing else: the baseline of a sync's cost."""
        group, spec = self._require()
        seconds = wire.send_raw(group, nbytes, bucket_bytes, _device(spec.backend), spec.timeout_s)
        return {"bytes": float(nbytes), "seconds": seconds}

    def close(self) -> None:
        self._group = self._store = self._spec = None

    def _require(self) -> tuple[Any, GroupSpec]:
        if self._group is None or self._spec is None:
            raise RuntimeError("weight broadcaster: not connected to a weight-transfer group (connect first)")
        return self._group, self._spec


def source_buckets(source: WeightSource, dtype: torch.dtype | None) -> Iterable[Sequence[tuple[str, Any]]]:
    """The buckets to pack: uncopied where the source offers them (`raw_buckets`), else its copies."""
    raw = getattr(source, "raw_buckets", None)
    return raw(dtype) if callable(raw) else source.buckets()


def bucket_bytes_of(source: WeightSource) -> int:
    """The source's bucket size (what bounds the wire buffers in flight)."""
    return int(getattr(source, "bucket_bytes", 256 << 20))


class LocalWeightSender:
    """`WeightSender` for a trainer in this process: a `WeightBroadcaster` driven from a thread."""

    local = True

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._broadcaster = WeightBroadcaster()

    async def rendezvous(self) -> tuple[str, int]:
        return WeightBroadcaster.rendezvous()

    async def connect(self, spec: GroupSpec) -> None:
        await _in_thread(self._broadcaster.connect, spec, timeout_s=spec.timeout_s + 5, what="joining")

    async def send(self, source: WeightSource, dtype: str, timeout_s: float) -> dict[str, float]:
        torch_dtype = getattr(torch, dtype)
        stats: dict[str, float] = await _in_thread(
            lambda: self._broadcaster.send(source_buckets(source, torch_dtype), torch_dtype, bucket_bytes_of(source)),
            timeout_s=timeout_s, what="sending",
        )  # fmt: skip
        return stats

    async def send_bare(self, nbytes: int, bucket_bytes: int, timeout_s: float) -> dict[str, float]:
        stats: dict[str, float] = await _in_thread(
            self._broadcaster.send_bare, nbytes, bucket_bytes, timeout_s=timeout_s, what="sending"
        )
        return stats

    async def close(self) -> None:
        self._broadcaster.close()


def rank_call(rank: Any, call: str, *args: Any) -> Any:
    """Rank 0's side of a weight-transfer group, for a Ray rank actor holding `rank.trainer`.

    The actor forwards `weight_group(call, *args)` here; `call` is rendezvous,
    connect (a GroupSpec), send (dtype name, bucket MB) or close. The
    broadcaster (and its group) lives on the actor between calls.
    """
    broadcaster: WeightBroadcaster | None = getattr(rank, "_weight_broadcaster", None)
    if broadcaster is None:
        broadcaster = rank._weight_broadcaster = WeightBroadcaster()
    if call == "rendezvous":
        return WeightBroadcaster.rendezvous()
    if call == "connect":
        broadcaster.connect(args[0])
        return None
    if call == "send":
        dtype = getattr(torch, args[0])
        source = rank.trainer.state_for_engines(dtype=dtype, bucket_mb=args[1])
        return broadcaster.send(source_buckets(source, dtype), dtype, bucket_bytes_of(source))
    if call == "close":
        broadcaster.close()
        return None
    raise ValueError(f"weight_group: unknown call {call!r}")


class RankZeroSender:
    """`WeightSender` for a trainer whose rank 0 is a Ray actor with `weight_group(call, *args)` (see `rank_call`).

    `helpers(dtype, bucket_mb)` starts the other ranks' part of a send (under
    FSDP / ZeRO-3 they iterate the weights along to gather each tensor) and
    returns their object refs; it returns [] when rank 0 holds everything.
    """

    local = False

    def __init__(
        self, rank0: Any, bucket_mb: float | None, helpers: Callable[[Any, float | None], list[Any]], *,
        device: str = "cpu",
    ) -> None:  # fmt: skip
        self._rank0, self._bucket_mb, self._helpers, self.device = rank0, bucket_mb, helpers, device

    async def rendezvous(self) -> tuple[str, int]:
        host, port = await self._rank0.weight_group.remote("rendezvous")
        return str(host), int(port)

    async def connect(self, spec: GroupSpec) -> None:
        async with asyncio.timeout(spec.timeout_s + 5):
            await self._rank0.weight_group.remote("connect", spec)

    async def send(self, source: WeightSource, dtype: str, timeout_s: float) -> dict[str, float]:
        refs = [
            self._rank0.weight_group.remote("send", dtype, self._bucket_mb),
            *self._helpers(getattr(torch, dtype), self._bucket_mb),
        ]
        try:
            async with asyncio.timeout(timeout_s):
                results = await asyncio.gather(*refs)
        except BaseException:
            for ref in refs:
                _cancel(ref)
            raise
        stats: dict[str, float] = results[0]
        counted: Any = source
        if hasattr(counted, "sent_bytes"):  # what the run logs as weight_sync/*: rank 0 counted it
            counted.sent_bytes += int(stats["bytes"])
            counted.sent_buckets += int(stats["buckets"])
        return stats

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30):
                await self._rank0.weight_group.remote("close")


async def _in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    """`fn(*args)` in a thread, awaited at most `timeout_s` (the group's own timeout ends the thread's wait too)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(fn, *args)
    except TimeoutError as e:
        raise TimeoutError(f"trainer rank 0: {what} weights took longer than {timeout_s:.0f}s") from e


def _node_address() -> str:
    """This node's address as the cluster knows it (Ray running), else loopback (one machine)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref)
