"""An LRU store of KV caches keyed by token prefixes, for the hf engine's prefix caching.

The KV of the first L tokens of a causal LM depends only on those L tokens
(and the weights), so an entry holding the KV of tokens t[0:T] serves any
prompt that shares its first L <= T tokens with t: the engine copies those L
columns and prefills only the rest. Entries are tagged with the epoch they
were computed under: the weights epoch for the base, and for each named LoRA
adapter an epoch of its own (a fresh one at each of its updates), so KV
computed under one adapter never serves another. `lookup` matches only the
epoch asked for; the engine clears the store whenever it copies new base
weights and drops an adapter's epoch when that adapter changes.

Entries that are a prefix of another entry are dropped (the longer one serves
every prompt the shorter one does), so a multi-turn episode keeps one entry
that grows turn by turn. The total number of cached tokens stays at or below
`max_tokens` by evicting the least recently used entries; 0 disables.

Imports torch: only the hf engine imports this module. Worker-thread only (the
engine calls it under its step lock); not thread-safe by itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

KVSlicer = Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""Given n, owned per-layer copies (keys, values) of the first n tokens' KV, [heads, n, head_dim] each."""


@dataclass(eq=False, slots=True)
class PrefixEntry:
    """The KV of `tokens` for every layer: keys[l], values[l] are [heads, len(tokens), head_dim]."""

    tokens: torch.Tensor  # [T] long, on the CPU
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    epoch: int  # the engine's weights epoch: matched only while it is current

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    diff = a[:n] != b[:n]
    return int(diff.int().argmax()) if bool(diff.any()) else n


class PrefixCache:
    """Longest-prefix lookup over LRU-ordered KV entries, bounded in total tokens."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, LRU first
        self.tokens = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        """Entries from least to most recently used."""
        return list(self._entries.values())

    def lookup(self, prompt: torch.Tensor, epoch: int, limit: int) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens), and that length.

        A hit marks the entry as recently used. (None, 0) when nothing matches.
        """
        best: PrefixEntry | None = None
        best_len = 0
        if limit <= 0:
            return None, 0
        for entry in self._entries.values():
            if entry.epoch != epoch or int(entry.tokens[0]) != int(prompt[0]):
                continue
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n > best_len:
                best, best_len = entry, n
                if n == limit:
                    break
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, best_len

    def insert(self, tokens: Sequence[int], kv: KVSlicer, *, epoch: int) -> None:
        """Store the KV of `tokens`; `kv(n)` returns owned copies of the first n tokens' KV.

        Longer than `max_tokens`: only the first `max_tokens` are kept (a prefix's KV is
        still valid). Already covered by an entry: that entry is marked used instead,
        and `kv` is not called. Entries that are a prefix of the new one are dropped.
        """
        if not self.enabled or not tokens:
            return
        ids = torch.tensor(list(tokens[: self.max_tokens]), dtype=torch.long)
        n = int(ids.shape[0])
        for key, entry in list(self._entries.items()):
            if entry.epoch != epoch:
                continue
            shared = common_prefix(entry.tokens, ids)
            if shared == n:  # the new tokens are already covered
                self._entries.move_to_end(key)
                return
            if shared == len(entry):  # the old entry is a prefix of the new one
                self._drop(key)
        keys, values = kv(n)
        entry = PrefixEntry(ids, keys, values, epoch)
        self._entries[id(entry)] = entry
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def drop_epoch(self, epoch: int) -> None:
        """Drop the entries of one epoch (an adapter's KV once its tensors change or it is removed)."""
        for key in [k for k, e in self._entries.items() if e.epoch == epoch]:
            self._drop(key)

    def clear(self) -> None:
        """Drop every entry (new weights make all of them stale)."""
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.tokens -= len(entry)
