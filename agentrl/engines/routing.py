"""Which engine replica serves a request: the one holding most of its prefix, unless that one is busy.

Multi-turn episodes resend their whole conversation every turn, and the
members of a GRPO group share their first prompt. An engine with a prefix
cache prefills only what it has not seen, so a request should go to the
replica that already holds the longest prefix of it. `PrefixRouter` keeps,
per block of `block_tokens` tokens (a chained hash, so a block stands for
everything before it too), the set of replicas that saw it. A request goes
to the replica holding its deepest prefix when that is at least
`min_gain_tokens` deeper than what the least loaded replica holds and that
replica has fewer than `max_imbalance` more requests in flight than the least
loaded one; otherwise to the least loaded replica. So a prefix every replica
holds (a shared system prompt) does not pull requests together, and affinity
never piles a whole run onto one replica. The map is an LRU of at most
`max_blocks` blocks. Torch-free, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NoReplica(RuntimeError):
    """Every replica is marked dead."""


class PrefixRouter:
    """Routes requests to replicas by longest known prefix, with a bound on load imbalance."""

    def __init__(
        self, replicas: int, *, block_tokens: int = 16, max_imbalance: int = 8, min_gain_tokens: int = 32,
        max_blocks: int = 200_000, affinity: bool = True,
    ) -> None:  # fmt: skip
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_imbalance = max_imbalance
        self.min_gain_tokens = min_gain_tokens
        self.max_blocks = max_blocks
        self.affinity = affinity
        self.in_flight = [0] * replicas
        self.alive = [True] * replicas
        self.routed = [0] * replicas
        self.by_prefix = 0  # requests that went to the replica of their prefix
        self.by_load = 0  # requests that went to the least loaded replica
        self._holders: OrderedDict[int, int] = OrderedDict()  # block hash -> bit mask of replicas

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of `tokens` (block i's hash covers tokens[: (i+1)*B])."""
        out = []
        h = 0
        b = self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            h = hash((h, tuple(tokens[start : start + b])))
            out.append(h)
        return out

    def choose(self, prompt: Sequence[int]) -> int:
        """The replica for `prompt`; counts it in flight there until `release`."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise NoReplica("every engine replica is dead")
        least = min(live, key=lambda i: (self.in_flight[i], self.routed[i]))
        hashes = self.block_hashes(prompt)
        choice = least
        if self.affinity and hashes:
            depth = self._depths(hashes)
            best = max(live, key=lambda i: (depth[i], -self.in_flight[i]))
            gain = (depth[best] - depth[least]) * self.block_tokens
            if gain >= self.min_gain_tokens and self.in_flight[best] - self.in_flight[least] < self.max_imbalance:
                choice = best
        if choice == least:
            self.by_load += 1
        else:
            self.by_prefix += 1
        self.in_flight[choice] += 1
        self.routed[choice] += 1
        self._remember(hashes, choice)  # the rest of a group that arrives now follows this one
        return choice

    def release(self, replica: int, served: Sequence[int] | None = None) -> None:
        """A request on `replica` ended; `served` (prompt + completion ids) is now in its cache."""
        self.in_flight[replica] -= 1
        if served is not None and self.alive[replica]:
            self._remember(self.block_hashes(served), replica)

    def mark_dead(self, replica: int) -> None:
        """Route nothing more to `replica` and forget what it held."""
        self.alive[replica] = False
        bit = 1 << replica
        for h in list(self._holders):
            mask = self._holders[h] & ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]

    def revive(self, replica: int) -> None:
        """Route to `replica` again (a new engine in its place: it holds no prefix yet)."""
        self.alive[replica] = True

    def holders(self, tokens: Sequence[int]) -> list[int]:
        """The replicas known to hold the deepest known prefix of `tokens` (empty when none)."""
        for h in reversed(self.block_hashes(tokens)):
            mask = self._holders.get(h, 0)
            if mask:
                return [i for i in range(len(self.alive)) if mask >> i & 1]
        return []

    def _depths(self, hashes: list[int]) -> list[int]:
        """Per replica, how many leading blocks of the request it holds."""
        depth = [0] * len(self.alive)
        missing = sum(1 << i for i, ok in enumerate(self.alive) if ok)
        for n in range(len(hashes), 0, -1):
            mask = self._holders.get(hashes[n - 1], 0) & missing
            if mask:
                for i in range(len(depth)):
                    if mask >> i & 1:
                        depth[i] = n
                missing &= ~mask
                if not missing:
                    break
        return depth

    def _remember(self, hashes: list[int], replica: int) -> None:
        holders = self._holders
        bit = 1 << replica
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit
            holders.move_to_end(h)
        while len(holders) > self.max_blocks:
            holders.popitem(last=False)
