"""The weight-sync coordinator (`agentrl.weights.sync.CollectiveSync`) over fake members and a fake sender.

No vLLM, Ray or torch: the members and the trainer's end record what they are
asked; a member can die (its receive raises a "gone" error), hang (its
receive and its ping never return) or fail. The real engines run the same
coordinator in tests/agentrl/engines/test_vllm_collective.py and
test_ray_pool_collective.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from agentrl.weights.sync import CollectiveSync, Member, require_sender, resolve_transport
from agentrl.weights.transport import GroupSpec, WeightSyncError


class Gone(Exception):
    """A member's process is gone."""


class FakeSender:
    local = False
    device = "cpu"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.specs: list[GroupSpec] = []
        self.sends = 0
        self.closes = 0

    async def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 1000 + len(self.specs)

    async def connect(self, spec: GroupSpec) -> None:
        self.specs.append(spec)

    async def send(self, source: Any, dtype: str, timeout_s: float) -> dict[str, float]:
        if self.fail:
            raise RuntimeError("rank 0 lost its GPU")
        self.sends += 1
        return {"bytes": 1.0}

    async def close(self) -> None:
        self.closes += 1


class Weights:
    def __init__(self, sender: FakeSender | None) -> None:
        self.sender = sender

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        yield from ()

    def weight_sender(self) -> Any:
        return self.sender


class FakeMember:
    def __init__(self, name: str, workers: int = 1) -> None:
        self.name, self.workers = name, workers
        self.mode = "ok"  # ok | dies | hangs | fails
        self.joined: list[dict[str, Any]] = []
        self.received: list[int] = []
        self.left = 0

    async def weight_workers(self, timeout_s: float) -> int:
        return self.workers

    async def serving_dtype(self, timeout_s: float) -> str:
        return "float32"

    async def join(self, init_info: dict[str, Any], timeout_s: float) -> None:
        self.joined.append(init_info)

    async def receive(self, version: int, timeout_s: float) -> None:
        if self.mode == "dies":
            raise Gone(f"{self.name} was killed")
        if self.mode == "hangs":
            async with asyncio.timeout(timeout_s):
                await asyncio.Event().wait()
        if self.mode == "fails":
            raise RuntimeError("the group broke")
        self.received.append(version)

    async def leave(self, timeout_s: float) -> None:
        self.left += 1

    async def ping(self, timeout_s: float) -> bool:
        if self.mode == "hangs":
            async with asyncio.timeout(timeout_s):
                await asyncio.Event().wait()
        return True

    def died(self, exc: BaseException) -> bool:
        return isinstance(exc, Gone)


class FakeFleet:
    """Members 0..n-1; a lost one is replaced by a fresh member that waits for the next sync."""

    def __init__(self, n: int) -> None:
        self.members = [FakeMember(f"m{i}") for i in range(n)]
        self.alive = [True] * n
        self.lost_lines: list[str] = []
        self.held: list[int] = []

    async def targets(self) -> list[int]:
        return [i for i, ok in enumerate(self.alive) if ok]

    def member(self, index: int) -> Member:
        return self.members[index]

    def describe(self, index: int) -> str:
        return f"engine replica {index}"

    def lost(self, index: int, member: Member, line: str) -> None:
        self.lost_lines.append(line)
        self.alive[index] = False
        self.members[index] = FakeMember(f"m{index}-new")

    def hold(self, index: int) -> None:
        self.held.append(index)

    def synced(self, targets: list[int]) -> None:
        for i in targets:
            self.alive[i] = True


def _sync(fleet: FakeFleet, **kw: Any) -> CollectiveSync:
    kw.setdefault("timeout_s", 0.2)
    return CollectiveSync(fleet, on_gpu=False, otherwise="object_store", size=len(fleet.members), **kw)


@pytest.mark.asyncio
async def test_one_group_ranks_every_worker_and_is_kept_while_its_members_stay() -> None:
    fleet = FakeFleet(2)
    fleet.members[1].workers = 2
    sync, sender = _sync(fleet), FakeSender()
    await sync.update(Weights(sender), 1)
    [spec] = sender.specs
    assert spec.world_size == 4  # the trainer + 1 + 2 workers
    assert [m.joined[0]["rank_offset"] for m in fleet.members] == [1, 2]
    await sync.update(Weights(FakeSender()), 2)  # the kept group's sender is used, not the new source's
    assert len(sender.specs) == 1 and sender.sends == 2 and sync.sender is sender
    assert [m.received for m in fleet.members] == [[1, 2], [1, 2]]


@pytest.mark.asyncio
async def test_a_dead_member_is_named_and_replaced_and_the_others_sync_over_a_new_group() -> None:
    fleet = FakeFleet(2)
    sync = _sync(fleet)
    await sync.update(Weights(FakeSender()), 1)
    first = fleet.members[0]
    fleet.members[1].mode = "dies"
    retry = FakeSender()
    await sync.update(Weights(retry), 2)
    assert sync.failures == ["engine replica 1 died (Gone: m1 was killed) during the weight sync to version 2"]
    assert fleet.lost_lines == sync.failures and fleet.held == [0]
    assert first.received == [1, 2, 2] and first.left == 1  # took it in both groups; left the broken one
    assert sync.members == [first] and retry.specs[0].world_size == 2


@pytest.mark.asyncio
async def test_a_hung_member_is_named_after_its_deadline_and_ping() -> None:
    fleet = FakeFleet(2)
    fleet.members[0].mode = "hangs"
    sync = _sync(fleet)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("agentrl.weights.sync.PING_S", 0.1)
        await sync.update(Weights(FakeSender()), 1)
    assert len(sync.failures) == 1 and sync.failures[0].startswith("engine replica 0 hung: no answer within")
    assert fleet.members[1].received == [1, 1] and fleet.alive == [False, True]  # again, in the new group


@pytest.mark.asyncio
async def test_when_every_member_answers_the_trainers_side_is_blamed() -> None:
    fleet = FakeFleet(2)
    sync = _sync(fleet)
    with pytest.raises(WeightSyncError, match=r"the trainer's rank 0 could not broadcast version 1: RuntimeError"):
        await sync.update(Weights(FakeSender(fail=True)), 1)
    assert fleet.lost_lines == [] and sync.sender is None and sync.members == []  # the group is torn down


@pytest.mark.asyncio
async def test_no_member_left_raises_naming_the_failures() -> None:
    fleet = FakeFleet(1)
    fleet.members[0].mode = "dies"
    sync = _sync(fleet, attempts=1)
    with pytest.raises(WeightSyncError, match=r"version 3 reached no engine replica: engine replica 0 died"):
        await sync.update(Weights(FakeSender()), 3)


@pytest.mark.asyncio
async def test_weights_that_cannot_broadcast_are_a_clear_value_error() -> None:
    sync = _sync(FakeFleet(1))
    with pytest.raises(ValueError, match=r"no weight_sender\(\)\); use weight_transport=object_store"):
        await sync.update(Weights(None), 1)
    assert not sync.used
    with pytest.raises(ValueError, match="use weight_transport=shm"):
        require_sender(Weights(None), "shm")


def test_auto_picks_collective_only_when_it_can_work() -> None:
    remote, local = FakeSender(), FakeSender()
    local.local = True  # type: ignore[misc]
    pick = resolve_transport
    assert pick("auto", Weights(remote), collective_ok=True, remote_only=True, otherwise="shm") == "collective"
    assert pick("auto", Weights(local), collective_ok=True, remote_only=True, otherwise="shm") == "shm"
    assert pick("auto", Weights(local), collective_ok=True, remote_only=False, otherwise="x") == "collective"
    assert pick("auto", Weights(remote), collective_ok=False, remote_only=False, otherwise="x") == "x"
    assert pick("auto", Weights(None), collective_ok=True, remote_only=False, otherwise="x") == "x"
    assert pick("shm", Weights(remote), collective_ok=True, remote_only=True, otherwise="shm") == "shm"
