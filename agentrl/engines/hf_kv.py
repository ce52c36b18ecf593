"""KV-cache tensor surgery for the hf engine's continuous batching (worker thread only).

A `KVBatch` is the running rows and their shared left-padded KV cache (a
transformers `DynamicCache`). `merge` joins two batches (left-padding the
shorter cache), `select` keeps some rows and drops columns that are padding in
all of them, `pack` moves each row's real columns to the right after a prefill
with holes (prefix-cache hits of different lengths), `past_cache` builds the
left-padded cache of cached prefixes a prefill starts from, and `row_kv`
copies one row's last columns out for the prefix store. The scheduler that
decides when each happens is `agentrl.engines.hf.HFEngine`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from agentrl.engines.prefix_cache import PrefixEntry

R = TypeVar("R")


@dataclass
class KVBatch(Generic[R]):
    """The running rows and their shared left-padded KV cache."""

    rows: list[R]
    cache: Any  # transformers DynamicCache
    attn: torch.Tensor  # [B, L] 1 = real token in the cache, 0 = left padding
    pos: torch.Tensor  # [B] position id of the next input token
    next_ids: torch.Tensor  # [B] last sampled token, not yet in the cache


def past_cache(hits: Sequence[tuple[PrefixEntry | None, int]], past: int, config: Any) -> Any:
    """A DynamicCache holding each row's cached prefix KV (`n` tokens of its entry), left-padded with zeros to `past`."""
    from transformers import DynamicCache

    some = next(e for e, n in hits if e is not None and n)
    data = []
    for layer in range(len(some.keys)):
        heads, _, dim = some.keys[layer].shape
        keys = some.keys[layer].new_zeros((len(hits), heads, past, dim))
        values = some.values[layer].new_zeros((len(hits), heads, past, dim))
        for i, (entry, n) in enumerate(hits):
            if entry is not None and n:
                entry.copy_into(layer, n, keys[i, :, past - n :], values[i, :, past - n :])
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data, config=config)


def row_kv(batch: KVBatch[Any], i: int, start: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of row i's keys and values in cache columns `start:start + n`, per layer."""
    layers = list(cache_layers(batch.cache))
    keys = [layer.keys[i, :, start : start + n].clone() for layer in layers]
    values = [layer.values[i, :, start : start + n].clone() for layer in layers]
    return keys, values


def cache_layers(cache: Any) -> Iterator[Any]:
    yield from cache.layers


def plain_kv_cache(model: Any) -> bool:
    """Whether the model's cache is full per-layer KV (prefix caching needs every column kept)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # an exotic config: no prefix caching rather than a broken engine
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def pack(cache: Any, attn: torch.Tensor) -> torch.Tensor:
    """Move each row's real cache columns to the right end and zero the padding; return the new mask.

    After a prefill the batch is plain left padding again (what `merge`, `select`
    and `_remember` expect). Padded slots may hold garbage (even NaN): they are zeroed.
    """
    real = attn.bool()
    counts = real.sum(1)
    width = int(counts.max())
    packed = torch.arange(width).unsqueeze(0) >= (width - counts).unsqueeze(1)
    index = None
    if width != attn.shape[1] or not bool((real == packed).all()):
        index = torch.zeros(packed.shape, dtype=torch.long)
        for i in range(attn.shape[0]):
            cols = real[i].nonzero().squeeze(1)
            index[i, width - cols.shape[0] :] = cols
    for layer in cache_layers(cache):
        dev = layer.keys.device
        if index is not None:
            at = index.to(dev)[:, None, :, None]
            layer.keys = layer.keys.gather(2, at.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, at.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        pad = ~packed.to(dev)[:, None, :, None]
        layer.keys.masked_fill_(pad, 0)
        layer.values.masked_fill_(pad, 0)
    return packed.long()


def merge(old: KVBatch[R], new: KVBatch[R]) -> KVBatch[R]:
    """Concatenate two batches, left-padding the shorter KV cache so lengths agree."""
    width = max(old.attn.shape[1], new.attn.shape[1])

    def pad_kv(t: torch.Tensor) -> torch.Tensor:
        short = width - t.shape[2]
        return torch.nn.functional.pad(t, (0, 0, short, 0)) if short else t

    def pad_attn(a: torch.Tensor) -> torch.Tensor:
        short = width - a.shape[1]
        return torch.nn.functional.pad(a, (short, 0)) if short else a

    for lo, ln in zip(cache_layers(old.cache), cache_layers(new.cache), strict=True):
        lo.keys = torch.cat([pad_kv(lo.keys), pad_kv(ln.keys)], dim=0)
        lo.values = torch.cat([pad_kv(lo.values), pad_kv(ln.values)], dim=0)
    return KVBatch(
        rows=old.rows + new.rows,
        cache=old.cache,
        attn=torch.cat([pad_attn(old.attn), pad_attn(new.attn)], dim=0),
        pos=torch.cat([old.pos, new.pos]),
        next_ids=torch.cat([old.next_ids, new.next_ids]),
    )


def select(batch: KVBatch[R], keep: list[int]) -> KVBatch[R]:
    """Keep only rows `keep`, and drop cache columns that are padding in every kept row."""
    idx = torch.tensor(keep, dtype=torch.long)
    attn = batch.attn[idx]
    lead = int((attn.sum(0) > 0).long().argmax())  # first column some row uses
    for layer in cache_layers(batch.cache):
        layer.keys = layer.keys[idx.to(layer.keys.device), :, lead:]
        layer.values = layer.values[idx.to(layer.values.device), :, lead:]
    return KVBatch(
        rows=[batch.rows[i] for i in keep],
        cache=batch.cache,
        attn=attn[:, lead:],
        pos=batch.pos[idx],
        next_ids=batch.next_ids[idx],
    )
