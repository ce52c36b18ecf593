"""The weight-sync coordinator: one collective update for a `vllm` engine and for a `ray` pool of them.

`CollectiveSync` runs the `collective` transport for its owner, which is
either a `ray` pool (`RayEnginePool`: its replicas are the members) or a single
`vllm` engine (a pool of one: the engine is its only member). Per update:

1. take the trainer's end of the group (`WeightSender`, from the weights:
   `require_sender`), kept while the group lasts;
2. form the group when its members changed (a gloo or nccl group cannot take
   a new member): a fresh rendezvous, rank 0 the trainer, then each member's
   workers in order;
3. every member receives while rank 0 sends; every part has a deadline
   (`timeout_s`, the group's own collective timeout too);
4. on any failure the group is torn down on every end, and each member is
   probed: one that died, or that no longer answers a short ping (hung), is
   named (`failures`) and handed to the owner (`Fleet.lost`: a pool kills and
   replaces it), the others are held back from requests (`Fleet.hold`) and the
   sync runs again, over a new group, for those still fine (`attempts`).
   When every member answers, the trainer's side failed: `WeightSyncError`.

`resolve_transport` is the `weight_transport: auto` choice both owners make.
Kept free of torch, vLLM and Ray imports: members wrap their own calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from agentrl.engines.base import WeightSource
from agentrl.weights.transport import (
    GroupSpec,
    WeightSender,
    WeightSyncError,
    group_backend,
    sender_of,
    together,
)

log = logging.getLogger(__name__)
PING_S = 10.0  # how long a member has to answer after a failed sync before it counts as hung


class Member(Protocol):
    """One engine in a weight-transfer group, as the coordinator calls it; every call has a deadline.

    Members compare equal when they are the same engine (a pool's replica
    handle, or the engine itself): the group is formed anew when they change.
    """

    async def weight_workers(self, timeout_s: float) -> int: ...

    async def serving_dtype(self, timeout_s: float) -> str: ...

    async def join(self, init_info: dict[str, Any], timeout_s: float) -> None: ...

    async def receive(self, version: int, timeout_s: float) -> None: ...

    async def leave(self, timeout_s: float) -> None: ...

    async def ping(self, timeout_s: float) -> bool: ...

    def died(self, exc: BaseException) -> bool:
        """Whether `exc`, raised by one of this member's calls, says the member is gone."""
        ...


class Fleet(Protocol):
    """The owner of the members: which to sync, what they are called, what to do with the failed ones."""

    async def targets(self) -> list[int]:
        """The members to sync now, by index (a pool waits here for a restarting replica when none is live)."""
        ...

    def member(self, index: int) -> Member: ...

    def describe(self, index: int) -> str:
        """The member in a failure line, e.g. "engine replica 1 (node ab12)"."""
        ...

    def lost(self, index: int, member: Member, line: str) -> None:
        """`member` died or hung during a sync (`line` says so): end it and replace it where possible."""
        ...

    def hold(self, index: int) -> None:
        """`index` may hold half-loaded weights: serve nothing from it until a later sync loads it."""
        ...

    def synced(self, targets: list[int]) -> None:
        """Every one of `targets` loaded the new weights: serve from them again."""
        ...


def resolve_transport(
    chosen: str, weights: WeightSource, *, collective_ok: bool, remote_only: bool, otherwise: str
) -> str:
    """The transport for `weights`: `chosen`, or with `auto` collective when it can work, else `otherwise`.

    Collective works when the engines can join a group (`collective_ok`) and
    the weights offer a sender; with `remote_only` only when that sender is
    another process (an engine in the trainer's process takes `otherwise`).
    """
    if chosen != "auto":
        return chosen
    sender = sender_of(weights)
    usable = collective_ok and sender is not None and not (remote_only and sender.local)
    return "collective" if usable else otherwise


def require_sender(weights: WeightSource, otherwise: str) -> WeightSender:
    """The trainer's end of a group that `weights` offers; a ValueError naming `otherwise` when there is none."""
    sender = sender_of(weights)
    if sender is None:
        raise ValueError(
            f"engine.weight_transport=collective: the trainer's weights ({type(weights).__name__}) cannot be "
            f"broadcast (no weight_sender()); use weight_transport={otherwise}"
        )
    return sender


class CollectiveSync:
    """The collective transport of one owner (pool or engine): its group, its updates, its teardown."""

    def __init__(
        self, fleet: Fleet, *, timeout_s: float, on_gpu: bool, otherwise: str, size: int = 1, attempts: int = 2
    ) -> None:
        """`size`: the owner's members (failure lines quoted when none took the weights); `otherwise`: the
        transport a user should pick when the weights cannot broadcast; `attempts`: syncs per update."""
        self._fleet, self._timeout, self._on_gpu = fleet, timeout_s, on_gpu
        self._otherwise, self._size, self._attempts = otherwise, size, attempts
        self.sender: WeightSender | None = None  # the trainer's end, while a group is formed
        self.members: list[Member] = []  # the engines in the current group, in rank order
        self.used = False  # a collective update was asked for (restarted replicas then wait for the next one)
        self.failures: list[str] = []  # one line per member failure, run-long
        self._workers: dict[Member, int] = {}

    async def update(self, weights: WeightSource, version: int) -> None:
        """Broadcast `weights` into every target; replace the ones that fail and sync the rest again.

        The caller holds its update lock (the trainer is at a sync point: its
        weights do not move meanwhile). Raises WeightSyncError when no target
        took the weights, or when the trainer's side failed.
        """
        sender = self.sender or require_sender(weights, self._otherwise)  # before anything: a plain ValueError
        self.used = True
        for attempt in range(1, self._attempts + 1):
            targets = await self._fleet.targets()
            if not targets:
                break
            failures = await self._attempt(sender, targets, weights, version)
            if not failures:
                self._fleet.synced(targets)
                return
            log.warning("collective weight sync to version %d (attempt %d): %s", version, attempt, "; ".join(failures))
            sender = require_sender(weights, self._otherwise)  # the group was torn down: a fresh end for the next
        recent = "; ".join(self.failures[-self._size :]) or "every replica is dead"
        raise WeightSyncError(f"collective weight sync to version {version} reached no engine replica: {recent}")

    async def _attempt(
        self, sender: WeightSender, targets: list[int], weights: WeightSource, version: int
    ) -> list[str]:
        """One sync of `targets` (forming the group first when its members changed); what failed, per member."""
        timeout = self._timeout
        members = [self._fleet.member(i) for i in targets]
        outcomes: dict[int, BaseException | None] = {}
        sent: BaseException | None = None
        try:
            if members != self.members or self.sender is not sender:
                await self._form(sender, members)
            dtype = await members[0].serving_dtype(timeout)
            calls = {i: asyncio.ensure_future(m.receive(version, timeout + 5))
                     for i, m in zip(targets, members, strict=True)}  # fmt: skip
            sending = asyncio.ensure_future(sender.send(weights, dtype, timeout))
            parts = [*calls.values(), sending]
            try:
                await asyncio.wait(parts)
            except asyncio.CancelledError:  # the owner gave up: no member keeps half a sync running
                for part in parts:
                    part.cancel()
                await self.drop()
                raise
            outcomes = {i: call.exception() for i, call in calls.items()}
            sent = sending.exception()
        except Exception as e:  # forming the group failed: the probes below find out who is to blame
            outcomes, sent = {}, e
        if sent is None and all(e is None for e in outcomes.values()):
            return []
        await self.drop()
        return await self._blame(targets, members, outcomes, sent, version)

    async def _form(self, sender: WeightSender, members: list[Member]) -> None:
        """A fresh group of the trainer's rank 0 and every worker of `members` (ranks in that order)."""
        timeout = self._timeout
        await self.drop()
        for m in members:
            if m not in self._workers:
                self._workers[m] = await m.weight_workers(timeout)
        self._workers = {m: self._workers[m] for m in members}  # forget members that left for good
        self.sender = sender
        host, port = await sender.rendezvous()
        offsets, rank = [], 1
        for m in members:
            offsets.append(rank)
            rank += self._workers[m]
        spec = GroupSpec(host, port, rank, timeout, backend=group_backend(sender.device, self._on_gpu))
        await together(sender.connect(spec), *(m.join(spec.worker_init(o), timeout + 15)
                                               for m, o in zip(members, offsets, strict=True)))  # fmt: skip
        self.members = list(members)

    async def drop(self) -> None:
        """Tear the current group down on every end (best effort: a member may be dead)."""
        sender, self.sender = self.sender, None
        members, self.members = self.members, []
        if sender is not None:
            try:
                await sender.close()
            except Exception as e:  # its end died with a lost trainer rank; the members leave all the same
                log.warning("closing the trainer's end of the weight-transfer group: %s", gist(e))
        if members:
            await asyncio.gather(*(m.leave(40) for m in members), return_exceptions=True)

    async def close(self) -> None:
        """The owner closes: end the trainer's side of the group (the members close with their engines)."""
        sender, self.sender, self.members = self.sender, None, []
        if sender is not None:
            try:
                await sender.close()
            except Exception as e:
                log.warning("closing the trainer's end of the weight-transfer group: %s", gist(e))

    async def _blame(
        self, targets: list[int], members: list[Member], outcomes: dict[int, BaseException | None],
        sent: BaseException | None, version: int,
    ) -> list[str]:  # fmt: skip
        """Name what failed; hand members that died or hung to the owner; hold the rest for the retry."""
        failures, failed = [], set()
        for i, m in zip(targets, members, strict=True):
            exc = outcomes.get(i)
            what = f"died ({gist(exc)})" if exc is not None and m.died(exc) else await self._probe(m)
            if what is None:
                continue  # it answers: the failure was another member's; it takes part in the retry
            line = f"{self._fleet.describe(i)} {what} during the weight sync to version {version}"
            failures.append(line)
            self.failures.append(line)
            failed.add(i)
            self._fleet.lost(i, m, line)
        if not failures:  # every member answers: the trainer's side failed
            cause = sent or next(e for e in outcomes.values() if e is not None)
            line = f"the trainer's rank 0 could not broadcast version {version}: {gist(cause)}"
            self.failures.append(line)
            raise WeightSyncError(line) from cause
        for i in targets:  # the others may hold half-loaded weights: no requests until the retry loads them
            if i not in failed:
                self._fleet.hold(i)
        return failures

    async def _probe(self, member: Member) -> str | None:
        """None when `member` answers a ping within PING_S; else what is wrong with it."""
        try:
            if await member.ping(PING_S):
                return None
            return "its engine is dead"
        except TimeoutError:
            return (f"hung: no answer within engine.update_timeout_s={self._timeout}s nor to a {PING_S:.0f}s "
                    "ping afterwards")  # fmt: skip
        except Exception as e:
            return f"died ({gist(e)})" if member.died(e) else f"failed ({gist(e)})"


def gist(exc: BaseException) -> str:
    """`Type: first line` of an exception (a Ray task error: of the remote exception it carries)."""
    cause = getattr(exc, "cause", None)  # RayTaskError carries the replica's own exception
    inner = cause if isinstance(cause, BaseException) else exc
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else 'no message'}"
