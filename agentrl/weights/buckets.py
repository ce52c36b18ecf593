"""Weight hand-off to engines: named tensors (HF names) in size-bounded buckets.

`NamedTensorBuckets` implements the core `WeightSource` protocol
(agentrl/engines/base.py). Tensors are produced lazily and copied one bucket at
a time, so a hand-off never holds more than one bucket of extra memory, and the
copies stay valid while the trainer keeps training. With LoRA the adapters are
merged on the fly (W + scale * B @ A) under the base model's parameter names,
so an engine loads them like any full checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from agentrl.weights.delta import Patch, apply_patch, decoded


class NamedTensorBuckets:
    """A `WeightSource`: `buckets()` yields lists of (name, tensor) of <= bucket_mb each.

    A tensor larger than the bucket is sent alone. `dtype` casts floating tensors
    (e.g. bf16 for an engine serving in bf16); None keeps the trainer's dtype.
    """

    def __init__(
        self,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        *,
        bucket_mb: float = 256.0,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        source_device: str = "cpu",
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self._named_tensors = named_tensors
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.dtype = dtype
        self.device = device
        self.source_device = source_device  # where the trainer's tensors live: picks the broadcast's backend
        self.sent_bytes = 0  # what `buckets()` has handed out so far (the run logs `weight_sync/*`)
        self.sent_buckets = 0

    def buckets(self) -> Iterator[Sequence[tuple[str, torch.Tensor]]]:
        yield from self._grouped(copy=True)

    def raw_buckets(self, dtype: torch.dtype | None = None) -> Iterator[Sequence[tuple[str, torch.Tensor]]]:
        """The same buckets (sized for `dtype`, default this source's) of the trainer's own tensors, not copied.

        For a sender that copies each tensor straight into its wire buffer
        (`agentrl.weights.sender`): one bucket of extra memory
        instead of two. The tensors are only valid until the trainer's next step.
        """
        yield from self._grouped(copy=False, dtype=dtype or self.dtype)

    def _grouped(self, *, copy: bool, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._named_tensors():
            t = tensor.detach()
            if copy:
                if self.dtype is not None and t.is_floating_point():
                    t = t.to(self.dtype)
                t = t.to(self.device, copy=True).contiguous()
            item = t.element_size() if copy or dtype is None or not t.is_floating_point() else dtype.itemsize
            nbytes = t.numel() * item
            if bucket and size + nbytes > self.bucket_bytes:
                self.sent_bytes, self.sent_buckets = self.sent_bytes + size, self.sent_buckets + 1
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            self.sent_bytes, self.sent_buckets = self.sent_bytes + size, self.sent_buckets + 1
            yield bucket

    def names(self) -> list[str]:
        return [n for n, _ in self._named_tensors()]

    def weight_sender(self) -> Any:
        """This process as rank 0 of a weight-transfer group (`agentrl.weights.transport.WeightSender`)."""
        from agentrl.weights.sender import LocalWeightSender

        return LocalWeightSender(self.source_device)


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict under HF names, tied aliases (e.g. lm_head = embed) once.

    For a peft model the LoRA deltas are merged into the base weights and the
    peft prefixes (`base_model.model.`, `.base_layer`) are removed.
    """
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        yield from _merged_lora_tensors(model)
        return
    aliases = tied_aliases(model)
    for name, t in model.state_dict(keep_vars=False).items():
        if name not in aliases:
            yield name, t


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another, earlier-named parameter (a tied lm_head).

    Decided by parameter identity, so it is the same on every rank of an FSDP
    group, where each rank's shards (and their addresses) differ.
    """
    first: set[int] = set()
    aliases: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.add(name)
        first.add(id(p))
    return aliases


def _merged_lora_tensors(peft_model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()  # type: ignore[operator]
    lora_layers = {name: mod for name, mod in base.named_modules() if isinstance(mod, LoraLayer)}
    aliases = tied_aliases(base)
    for name, t in base.state_dict().items():
        if ".lora_" in name or "lora_embedding" in name or name in aliases:
            continue
        clean = name.replace(".base_layer.", ".")
        layer = lora_layers.get(name[: -len(".base_layer.weight")]) if name.endswith(".base_layer.weight") else None
        delta = _lora_delta(layer) if layer is not None else None
        # each delta is made as its weight is read: one weight's worth of memory, not the whole model's
        yield clean, t if delta is None else (t + delta.to(t.dtype)).detach()


@torch.no_grad()
def _lora_delta(layer: Any) -> torch.Tensor | None:
    """The sum of the active adapters' weight deltas of one LoRA layer (None: no active adapter)."""
    delta: torch.Tensor | None = None
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            d = layer.get_delta_weight(adapter)  # every concrete LoRA layer (Linear, Embedding, ...) defines it
            delta = d if delta is None else delta + d
    return delta


def copy_buckets_into(params: dict[str, torch.Tensor], buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
    """The receiving end in one process: copy each named tensor into the parameter (or buffer) of that name.

    An unknown name or another shape is an error naming it, before anything of
    that tensor is copied; the device and dtype are the target's. A delta sync's
    patches (`agentrl.weights.delta`) are written element-wise into their tensor.
    """
    for bucket in buckets:
        for item in decoded(bucket):
            if isinstance(item, Patch):
                apply_patch(_target(params, item.name), item)
                continue
            name, tensor = item
            target = _target(params, name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))


def _target(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    target = params.get(name)
    if target is None:
        raise KeyError(f"update_weights: unknown parameter {name!r} (the model has e.g. {', '.join(list(params)[:3])})")
    return target
