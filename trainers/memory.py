"""The torch trainer's own memory share, for the run's `memory/trainer/<key>` metrics (MiB by name).

- `weights_mb`: parameters and buffers of every model the trainer holds (policy,
  reference, critic; a storage shared between them counts once);
- `trainable_mb`: the parameters it updates (the adapters alone under LoRA);
- `grads_mb`: gradients held between steps (0 when they are freed after the step);
- `optimizer_mb`: optimizer state (AdamW: two moments per trainable parameter).

Counted from tensor storages, so it is what the trainer holds, not what the
allocator keeps; the gap to `memory/rss_mb` is the engine, activations in
flight, Python and allocator retention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

MB = float(2**20)


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() == 0:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def trainer_memory_mb(models: Sequence[nn.Module | None], optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """The trainer's share by name, in MiB (module docstring)."""
    held = [m for m in models if m is not None]
    params = [p for m in held for p in m.parameters()]
    out = {
        "weights_mb": _bytes([*params, *(b for m in held for b in m.buffers())]) / MB,
        "trainable_mb": _bytes(p for p in params if p.requires_grad) / MB,
        "grads_mb": _bytes(p.grad for p in params if p.grad is not None) / MB,
    }
    out["optimizer_mb"] = _bytes(_state_tensors(optimizer)) / MB if optimizer is not None else 0.0
    return out
