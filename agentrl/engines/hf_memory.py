"""The hf engine's own memory share, for the run's `memory/engine/<key>` metrics (MiB by name).

- `weights_mb`: bytes of the model's parameters and buffers that no other
  object in the process shares with it (a tensor whose storage `shared` names
  is not counted: the embedded engine that samples with the trainer's frozen
  base weights holds no copy of its own);
- `prefix_cache_mb`: KV kept for prefix reuse (bounded by `prefix_cache_tokens`);
- `kv_cache_mb`: KV of the running batch when the measurement is taken;
- `adapters_mb`: the named LoRA adapters it holds (`hf_adapters`; 0 without).

Imports torch: only the hf engine imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from agentrl.engines.prefix_cache import PrefixCache

MB = float(2**20)


def tensor_bytes(tensors: Iterable[torch.Tensor], *, skip: frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages of `tensors` (views of one storage count once), except those in `skip`."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or ptr in skip or storage.nbytes() == 0:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storages of `tensors`, to tell shared tensors apart (`tensor_bytes(skip=...)`)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def prefix_cache_bytes(cache: PrefixCache) -> int:
    return sum(tensor_bytes([*e.keys, *e.values]) for e in cache.entries())


def kv_bytes(cache: object) -> int:
    """Bytes of a transformers cache's per-layer keys and values (0 for None)."""
    layers = getattr(cache, "layers", None) or []
    return tensor_bytes(
        t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )  # fmt: skip


def engine_memory_mb(
    model: torch.nn.Module, prefix: PrefixCache, running_cache: object, shared: frozenset[int] = frozenset(),
    adapters_bytes: int = 0,
) -> dict[str, float]:
    """The engine's share by name, in MiB (module docstring)."""
    weights = tensor_bytes([*model.parameters(), *model.buffers()], skip=shared)
    return {
        "weights_mb": weights / MB,
        "prefix_cache_mb": prefix_cache_bytes(prefix) / MB,
        "kv_cache_mb": kv_bytes(running_cache) / MB,
        "adapters_mb": adapters_bytes / MB,
    }
