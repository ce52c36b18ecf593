"""The wire of a weight-transfer group: how it is formed, and how one bucket crosses it.

Both ends use it: the trainer's rank 0 (`agentrl.weights.sender`)
and every vLLM worker (`weight_transfer_gloo`). The group is a torch
process group made outside torch.distributed's global state (a TCPStore that
rank 0 hosts, and a gloo or nccl group over it), so it coexists with the
trainer's own group and with vLLM's.

A bucket travels as broadcasts from rank 0: a header (two int64: the length
of the metadata and of the packed buffer; 0, 0 ends the stream), the
metadata (JSON: name, dtype, shape and byte offset of each tensor), the
packed buffer (the small or cast tensors' bytes in one uint8 buffer at
16-byte aligned offsets) and then each big tensor that needs no cast straight
from the trainer's memory (no copy on the sender). The stream describes itself, so the sender can produce buckets
lazily (ZeRO-3 and FSDP gather each one just before it is sent) and the
receivers need nothing from the driver but "receive now".
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_ALIGN = 16


def local_address(toward: str, port: int) -> str:
    """This host's address on the route to `toward` (the address a peer there can reach us at)."""
    if toward in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, port))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the rendezvous of a new group)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
) -> tuple[Any, Any]:
    """Join the group meeting at host:port as `rank` (rank 0 hosts the store); returns (store, group).

    Blocks until all `world_size` members are in, or `timeout_s` passes.
    Every later collective of the group fails after `timeout_s` too.
    """
    timeout = timedelta(seconds=timeout_s)
    # TCPStore, PrefixStore and the groups' options are public torch API that torch's stubs do not re-export
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    prefix = dist.PrefixStore(f"agentrl-weights-{port}", store)  # type: ignore[attr-defined]
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, port))]
        group: Any = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
    elif backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefix, rank, world_size, nccl_opts)
    else:
        raise ValueError(f"weight-transfer group backend={backend!r}: use gloo or nccl")
    # the first collective completes the rendezvous: every member is in once it returns
    _broadcast(group, torch.zeros(1, dtype=torch.int64, device=_device(backend)), timeout_s)
    return store, group


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _broadcast(group: Any, tensor: torch.Tensor, timeout_s: float, *, wait: bool = True) -> Any:
    """Broadcast `tensor` from rank 0 within `timeout_s`; with wait=False the pending work is returned."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timedelta(seconds=timeout_s)
    work = group.broadcast([tensor], opts)
    if wait:
        work.wait()
    return work


DIRECT_MIN_BYTES = 1 << 20  # tensors this large that need no cast go on the wire as they are (no copy)


def is_direct(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> bool:
    """Whether `t` is sent straight from its own memory (big, contiguous, on the wire's device, not cast)."""
    return (
        _wire_dtype(t, dtype) == t.dtype and t.is_contiguous() and t.device == device
        and t.numel() * t.element_size() >= DIRECT_MIN_BYTES
    )  # fmt: skip


def packed_size(bucket: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None, device: torch.device) -> int:
    """Bytes the bucket's packed buffer takes (floating tensors cast to `dtype`; direct tensors not in it)."""
    size = 0
    for _, t in bucket:
        if not is_direct(t, dtype, device):
            item = torch.empty((), dtype=_wire_dtype(t, dtype)).element_size()
            size = _aligned(size) + t.numel() * item
    return size


def pack(
    bucket: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None, device: torch.device
) -> tuple[list[list[Any]], torch.Tensor, list[torch.Tensor]]:
    """The bucket's metadata, its small or cast tensors copied into one uint8 buffer, and its direct tensors.

    Each packed tensor is copied (and cast) straight into its slot; a direct
    tensor (`is_direct`) is broadcast from the trainer's own memory after the
    buffer, so it costs no copy and no extra memory. Metadata entries are
    [name, dtype, shape, offset in the buffer, or -1 for a direct tensor].
    """
    buf = torch.empty(packed_size(bucket, dtype, device), dtype=torch.uint8, device=device)
    meta: list[list[Any]] = []
    direct: list[torch.Tensor] = []
    offset = 0
    for name, t in bucket:
        wire = _wire_dtype(t, dtype)
        if is_direct(t, dtype, device):
            meta.append([name, str(wire).removeprefix("torch."), list(t.shape), -1])
            direct.append(t.detach().reshape(-1).view(torch.uint8))
            continue
        offset = _aligned(offset)
        nbytes = t.numel() * torch.empty((), dtype=wire).element_size()
        buf[offset : offset + nbytes].view(wire).view(t.shape).copy_(t.detach())
        meta.append([name, str(wire).removeprefix("torch."), list(t.shape), offset])
        offset += nbytes
    return meta, buf, direct


class InFlight:
    """A bucket's broadcasts, issued and not yet waited for (it keeps their buffers alive until then)."""

    def __init__(self, works: list[Any], buffers: list[torch.Tensor]) -> None:
        self._works, self._buffers = works, buffers

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._buffers = [], []


def send_bucket(
    group: Any, meta: list[list[Any]], payload: torch.Tensor, direct: Sequence[torch.Tensor], timeout_s: float
) -> InFlight:
    """Start broadcasting one bucket from rank 0 (header, metadata, packed buffer, direct tensors); wait on it.

    The group runs its operations in order, so the next bucket can be packed
    while this one is on the wire.
    """
    encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(payload.device)
    header = torch.tensor([encoded.numel(), payload.numel()], dtype=torch.int64, device=payload.device)
    tensors = [header, encoded, *([payload] if payload.numel() else []), *direct]
    works = [_broadcast(group, t, timeout_s, wait=False) for t in tensors]
    return InFlight(works, tensors)


def send_end(group: Any, device: torch.device, timeout_s: float) -> None:
    """Tell the receivers the stream is over."""
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device), timeout_s)


def send_raw(group: Any, nbytes: int, chunk: int, device: torch.device, timeout_s: float) -> float:
    """Broadcast `nbytes` bare bytes in `chunk`-byte pieces (no header, nothing loaded); returns the seconds.

    The baseline a benchmark compares a sync against. A one-element broadcast
    first waits for every receiver, so the time counts only the bytes.
    """
    import time

    _broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device), timeout_s)
    payload = torch.zeros(min(nbytes, chunk), dtype=torch.uint8, device=device)
    started = time.perf_counter()
    for offset in range(0, nbytes, chunk):
        _broadcast(group, payload[: min(chunk, nbytes - offset)], timeout_s)
    return time.perf_counter() - started


def receive_buckets(group: Any, device: torch.device, timeout_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets rank 0 broadcasts, until it ends the stream (packed tensors are views of their bucket's buffer)."""
    while True:
        header = torch.zeros(2, dtype=torch.int64, device=device)
        _broadcast(group, header, timeout_s)
        meta_len, payload_len = (int(x) for x in header.tolist())
        if meta_len == 0:
            return
        encoded = torch.empty(meta_len, dtype=torch.uint8, device=device)
        _broadcast(group, encoded, timeout_s)
        payload = torch.empty(payload_len, dtype=torch.uint8, device=device)
        if payload_len:
            _broadcast(group, payload, timeout_s)
        meta = json.loads(encoded.cpu().numpy().tobytes().decode())
        bucket = []
        for name, dtype_name, shape, offset in meta:
            dtype = getattr(torch, dtype_name)
            if offset < 0:  # a direct tensor: its own broadcast, after the buffer
                t = torch.empty(shape, dtype=dtype, device=device)
                _broadcast(group, t.reshape(-1).view(torch.uint8), timeout_s)
                bucket.append((name, t))
                continue
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            bucket.append((name, payload[offset : offset + nbytes].view(dtype).view(shape)))
        yield bucket


def receive_raw(group: Any, nbytes: int, chunk: int, device: torch.device, timeout_s: float) -> None:
    """The receiving side of `send_raw`."""
    _broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device), timeout_s)
    payload = torch.empty(min(nbytes, chunk), dtype=torch.uint8, device=device)
    for offset in range(0, nbytes, chunk):
        _broadcast(group, payload[: min(chunk, nbytes - offset)], timeout_s)


def _wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
