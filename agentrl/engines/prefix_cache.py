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

Entries form a tree so shared prefixes are stored once: a new entry that
shares its first `base` tokens with an entry already stored keeps only the KV
of its own tokens after `base` and reads the rest from that parent. A group
of samples of one prompt, or every task behind one system prompt and its
worked examples, then costs the shared part once (measured on the default
example: docs/rollout.md). An entry that extends another (the next turn of an
episode) is the extreme case: it stores only the new turn.

`tokens` (the bound `max_tokens`) counts the tokens whose KV is stored, each
once. Eviction takes the least recently used entry; a lookup or insert marks
an entry and all its ancestors used, so ancestors are always more recent than
their descendants and the entry evicted is a leaf (an inner entry is dropped
with its subtree only if nothing below it was used since). 0 disables.

Imports torch: only the hf engine imports this module. Worker-thread only (the
engine calls it under its step lock); not thread-safe by itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

KVSlicer = Callable[[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""Given (lo, hi), owned per-layer copies (keys, values) of tokens lo..hi-1's KV, [heads, hi - lo, head_dim] each."""


@dataclass(eq=False, slots=True)
class PrefixEntry:
    """The KV of `tokens` for every layer: its own tokens[base:] in keys[l], values[l]
    ([heads, len(tokens) - base, head_dim]); the first `base` from `parent`."""

    tokens: torch.Tensor  # [T] long, on the CPU
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    epoch: int  # the engine's weights epoch: matched only while it is current
    parent: PrefixEntry | None = None
    base: int = 0  # tokens read from the parent (0 without one)
    children: set[int] = field(default_factory=set)  # ids, not entries: no parent<->child cycle holds KV alive

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def own(self) -> int:
        """Tokens whose KV this entry stores itself."""
        return len(self) - self.base

    def copy_into(self, layer: int, n: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the first n tokens' KV of `layer` into keys/values ([heads, n, head_dim] views)."""
        if n > self.base:
            keys[:, self.base : n] = self.keys[layer][:, : n - self.base]
            values[:, self.base : n] = self.values[layer][:, : n - self.base]
        if self.parent is not None and self.base:
            m = min(n, self.base)
            self.parent.copy_into(layer, m, keys[:, :m], values[:, :m])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    diff = a[:n] != b[:n]
    return int(diff.int().argmax()) if bool(diff.any()) else n


class PrefixCache:
    """Longest-prefix lookup over LRU-ordered KV entries sharing their common prefixes, bounded in stored tokens."""

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

        A hit marks the entry (and its ancestors) as recently used. (None, 0) when nothing matches.
        """
        best, best_len = self._longest(prompt, epoch, limit)
        if best is not None:
            self._touch(best)
        return best, best_len

    def insert(self, tokens: Sequence[int], kv: KVSlicer, *, epoch: int) -> None:
        """Store the KV of `tokens`; `kv(lo, hi)` returns owned copies of tokens lo..hi-1's KV.

        Longer than `max_tokens`: only the first `max_tokens` are kept (a prefix's KV is
        still valid). Already covered by an entry: that entry is marked used instead,
        and `kv` is not called. Sharing a prefix with an entry: only the rest is copied.
        """
        if not self.enabled or not tokens:
            return
        ids = torch.tensor(list(tokens[: self.max_tokens]), dtype=torch.long)
        n = int(ids.shape[0])
        parent, shared = self._longest(ids, epoch, n)
        if parent is not None and shared == n:  # the new tokens are already covered
            self._touch(parent)
            return
        while parent is not None and parent.parent is not None and shared <= parent.base:
            parent = parent.parent  # the tokens shared live further up: depend on the entry that holds them
        keys, values = kv(shared, n)
        entry = PrefixEntry(ids, keys, values, epoch, parent, shared)
        self._entries[id(entry)] = entry
        if parent is not None:
            parent.children.add(id(entry))
        self._touch(entry)
        self.tokens += entry.own
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def drop_epoch(self, epoch: int) -> None:
        """Drop the entries of one epoch (an adapter's KV once its tensors change or it is removed)."""
        for key in [k for k, e in self._entries.items() if e.epoch == epoch]:
            if key in self._entries:
                self._drop(key)

    def clear(self) -> None:
        """Drop every entry (new weights make all of them stale)."""
        self._entries.clear()
        self.tokens = 0

    def _longest(self, prompt: torch.Tensor, epoch: int, limit: int) -> tuple[PrefixEntry | None, int]:
        best: PrefixEntry | None = None
        best_len = 0
        if limit <= 0:
            return None, 0
        first = int(prompt[0])
        for entry in self._entries.values():
            if entry.epoch != epoch or int(entry.tokens[0]) != first:
                continue
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n > best_len:
                best, best_len = entry, n
                if n == limit:
                    break
        return best, best_len

    def _touch(self, entry: PrefixEntry | None) -> None:
        """Mark `entry` used, then its ancestors, so each ancestor is more recent than what hangs below it."""
        while entry is not None:
            self._entries.move_to_end(id(entry))
            entry = entry.parent

    def _drop(self, key: int) -> None:
        """Drop an entry and its subtree (which reads the entry's KV)."""
        entry = self._entries.pop(key)
        self.tokens -= entry.own
        for child in list(entry.children):
            if child in self._entries:
                self._drop(child)
        if entry.parent is not None:
            entry.parent.children.discard(key)
