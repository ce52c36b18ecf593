"""Delta weight sync for full fine-tuning: send only the elements whose bits changed since the engine's version.

After one optimizer step at an RL learning rate most weights of a bf16 engine keep
their exact bits (an fp32 update of 1e-6 on a weight of 0.02 moves it by far less
than one bf16 step), so shipping the whole model every step sends mostly what the
engine already holds. `DeltaEncoder` keeps, per tensor, the bits it last sent in the
engine's dtype (one copy of the model in that dtype, on the trainer's side) and
encodes each new tensor as:

- nothing, when no element changed;
- a sparse patch (flat int32/int64 indices of the changed elements, their new values,
  the full shape) when that is smaller than the tensor;
- the whole tensor otherwise (fp32 under Adam changes nearly every element: the delta
  falls back to today's dense sync, tensor by tensor).

The comparison is bitwise in the engine's dtype, so the engine that applies every
patch holds exactly the bits a full sync would have given it: there is no drift to
correct with periodic full syncs. A delta is only valid against the version the
encoder last sent: the caller passes the version the engine serves, and any
mismatch (first sync, a failed or partial sync, a replaced engine) sends the whole
model and starts over.

The patch travels as ordinary named tensors (`<name>::delta::idx|val|shape`), so
every transport that moves named tensors moves it unchanged; `decoded` turns a
received bucket back into dense tensors and patches, and `apply_patches` applies
them to a module's parameters (the hf engine's receiving end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MARK = "::delta::"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Patch:
    """The changed elements of tensor `name`: flat `indices` into `shape`, their new `values`."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width: equal exactly when the bits are (NaN and -0.0 included)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


class DeltaEncoder:
    """The trainer's memory of what the engine holds: the bits it last sent, per tensor, in the wire dtype.

    `version` is the policy version those bits are (None before the first sync and after one
    that did not finish). Memory: one copy of the model in the wire dtype.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.dtype: torch.dtype | None = None
        self._sent: dict[str, torch.Tensor] = {}

    def source(
        self,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        *,
        version: int,
        engine_version: int,
        dtype: torch.dtype,
        bucket_mb: float = 256.0,
        source_device: str = "cpu",
    ) -> DeltaBuckets:
        """The sync from the engine's `engine_version` to `version`: a patch set when the encoder holds
        `engine_version` in `dtype`, else the whole model (and a fresh start)."""
        full = self.version is None or self.version != engine_version or self.dtype != dtype
        if full:
            self._sent.clear()
        self.version, self.dtype = None, dtype  # until every tensor has been encoded
        return DeltaBuckets(self, named_tensors, version=version, full=full, bucket_mb=bucket_mb,
                            source_device=source_device)  # fmt: skip

    def encode(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`tensor` as what to send (nothing, a patch's three tensors, or itself in the wire dtype); the
        encoder's copy of it becomes the new bits."""
        assert self.dtype is not None
        new = tensor.detach()  # on the trainer's device: so is the encoder's copy, and the patch's nonzero
        if new.is_floating_point():
            new = new.to(self.dtype)
        new = new.contiguous()
        before = self._sent.get(name)
        if before is None or before.shape != new.shape or before.dtype != new.dtype or not new.is_floating_point():
            self._sent[name] = new.clone()
            return [(name, new)]
        mask = _bits(new) != _bits(before)
        count = int(mask.sum())
        if count == 0:
            return []
        index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
        if count * (index_dtype.itemsize + new.element_size()) >= new.numel() * new.element_size():
            before.copy_(new)  # most elements moved: the tensor itself is smaller than its patch
            return [(name, new)]
        changed = torch.nonzero(mask, as_tuple=True)[0]
        values = new.reshape(-1)[changed]
        before.reshape(-1)[changed] = values
        shape = torch.tensor(list(new.shape), dtype=torch.int64)
        return [(name + MARK + "idx", changed.to(index_dtype)), (name + MARK + "val", values),
                (name + MARK + "shape", shape)]  # fmt: skip


class DeltaBuckets:
    """A counted `WeightSource` of one delta sync: buckets of encoded tensors of <= bucket_mb each.

    `sent_bytes` / `dense_bytes` is the share of the whole model (in the wire dtype) it sent.
    Iterating it to the end commits the encoder to `version`; one iteration only.
    """

    def __init__(
        self,
        encoder: DeltaEncoder,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        *,
        version: int,
        full: bool,
        bucket_mb: float,
        source_device: str = "cpu",
    ) -> None:
        self._encoder = encoder
        self._named_tensors = named_tensors
        self.version = version
        self.full = full  # the encoder held no base for the engine's version: every tensor is sent whole
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.source_device = source_device  # where the encoded tensors are: picks the broadcast's backend
        self.sent_bytes = 0
        self.sent_buckets = 0
        self.dense_bytes = 0  # what a full sync in the wire dtype would have sent
        self.patched_tensors = 0  # tensors sent as a patch
        self.touched_tensors = 0  # tensors with any element sent (patched or whole): what a receiver must reload
        self.tensors = 0
        self._used = False

    def buckets(self) -> Iterator[Sequence[tuple[str, torch.Tensor]]]:
        if self._used:
            raise RuntimeError("a delta sync's buckets can be read once (its encoder has moved on)")
        self._used = True
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._named_tensors():
            encoded = self._encoder.encode(name, tensor)
            dtype = self._encoder.dtype if tensor.is_floating_point() else tensor.dtype
            assert dtype is not None
            self.dense_bytes += tensor.numel() * dtype.itemsize
            self.patched_tensors += int(len(encoded) == 3)
            self.touched_tensors += int(bool(encoded))
            self.tensors += 1
            nbytes = sum(t.numel() * t.element_size() for _, t in encoded)
            if bucket and size + nbytes > self.bucket_bytes:
                yield self._counted(bucket, size)
                bucket, size = [], 0
            bucket += encoded
            size += nbytes
        if bucket:
            yield self._counted(bucket, size)
        self._encoder.version = self.version

    def _counted(self, bucket: list[tuple[str, torch.Tensor]], size: int) -> list[tuple[str, torch.Tensor]]:
        self.sent_bytes, self.sent_buckets = self.sent_bytes + size, self.sent_buckets + 1
        return bucket

    def weight_sender(self) -> Any:
        """This process as rank 0 of a weight-transfer group (the collective transport), as for a full sync."""
        from agentrl.weights.sender import LocalWeightSender

        return LocalWeightSender(self.source_device)

    @property
    def ratio(self) -> float:
        """Bytes sent over the bytes of the whole model in the wire dtype."""
        return self.sent_bytes / max(self.dense_bytes, 1)


def decoded(bucket: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor] | Patch]:
    """A received bucket as dense (name, tensor) pairs and `Patch`es (a patch's three tensors travel together)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in bucket:
        base, mark, part = name.partition(MARK)
        if not mark:
            yield name, tensor
            continue
        got = parts.setdefault(base, {})
        got[part] = tensor
        if len(got) == 3:
            del parts[base]
            yield Patch(base, tuple(int(d) for d in got["shape"].tolist()), got["idx"], got["val"])
    if parts:
        raise ValueError(f"delta sync: incomplete patch for {', '.join(sorted(parts))} (a bucket split a patch)")


def apply_patch(target: torch.Tensor, patch: Patch) -> None:
    """Write a patch's values into `target` in place; a shape or index out of range is an error naming it."""
    if tuple(target.shape) != patch.shape:
        raise ValueError(f"delta sync: {patch.name!r} has shape {patch.shape}, the model expects "
                         f"{tuple(target.shape)}")  # fmt: skip
    if patch.indices.numel() != patch.values.numel():
        raise ValueError(f"delta sync: {patch.name!r} has {patch.indices.numel()} indices and "
                         f"{patch.values.numel()} values")  # fmt: skip
    if patch.indices.numel() and (int(patch.indices.min()) < 0 or int(patch.indices.max()) >= target.numel()):
        raise ValueError(f"delta sync: {patch.name!r} has an index outside its {target.numel()} elements")
    target.view(-1).index_copy_(0, patch.indices.to(target.device, torch.long),
                                patch.values.to(device=target.device, dtype=target.dtype))  # fmt: skip

