"""PrefixRouter: longest known prefix wins, load imbalance is bounded, dead replicas are avoided."""

from __future__ import annotations

import pytest

from agentrl.engines.routing import NoReplica, PrefixRouter


def test_a_conversation_follows_the_replica_that_served_its_prefix() -> None:
    router = PrefixRouter(2, block_tokens=4, min_gain_tokens=4)
    first = list(range(10))
    r = router.choose(first)
    sibling = router.choose(first)  # a group member: goes where its prompt is, though the other replica is idle
    assert sibling == r and router.by_prefix == 1 and router.in_flight == [2 if i == r else 0 for i in range(2)]
    completion = [100, 101, 102, 103, 104]
    router.release(r, first + completion)
    # the next turn resends the conversation with the env's reply appended: it follows, though r is busier
    nxt = router.choose(first + completion + [7, 7, 7, 7, 7])
    assert nxt == r and router.by_prefix == 2
    assert router.holders(first + completion + [7]) == [r]


def test_group_members_arriving_together_share_a_replica() -> None:
    router = PrefixRouter(4, block_tokens=8)
    prompt = list(range(40))
    chosen = {router.choose(prompt) for _ in range(6)}
    assert len(chosen) == 1 and router.in_flight[chosen.pop()] == 6


def test_a_prefix_every_replica_holds_does_not_pull_requests_together() -> None:
    """A shared system prompt is held everywhere after a while: then load decides."""
    router = PrefixRouter(2, block_tokens=4, min_gain_tokens=8)
    system = list(range(100, 116))  # 4 blocks
    a = router.choose(system + [1] * 4)
    b = router.choose([9] * 8)  # unrelated: goes to the idle replica
    assert (a, b) == (0, 1)
    router.release(b, system + [2] * 4)  # replica 1 now holds the system prompt too
    router.release(a)
    assert router.holders(system) == [0, 1]
    picks = [router.choose(system + [3 + i] * 4) for i in range(4)]
    assert picks == [0, 1, 0, 1] and router.by_prefix == 0


def test_affinity_yields_to_load_past_max_imbalance() -> None:
    router = PrefixRouter(2, block_tokens=2, max_imbalance=3, min_gain_tokens=2)
    prompt = [1, 2, 3, 4]
    picks = [router.choose(prompt) for _ in range(5)]
    # 3 ahead of the idle replica is the limit: the 4th goes to the other one
    assert picks[:3] == [picks[0]] * 3 and picks[3] != picks[0]
    assert router.by_load >= 2


def test_short_prompts_and_least_loaded_mode_spread_by_load() -> None:
    router = PrefixRouter(2, block_tokens=64)
    assert router.block_hashes(list(range(63))) == []  # no full block: nothing to match
    assert sorted(router.choose([1, 2, 3]) for _ in range(4)) == [0, 0, 1, 1]
    plain = PrefixRouter(2, block_tokens=1, affinity=False)
    assert sorted(plain.choose([5, 5]) for _ in range(4)) == [0, 0, 1, 1]
    assert plain.by_prefix == 0


def test_chained_hashes_depend_on_everything_before() -> None:
    router = PrefixRouter(2, block_tokens=2)
    a = router.block_hashes([1, 2, 3, 4])
    b = router.block_hashes([9, 9, 3, 4])
    assert len(a) == 2 and a[1] != b[1]  # same second block, different history


def test_dead_replicas_get_nothing_and_their_prefixes_are_forgotten() -> None:
    router = PrefixRouter(2, block_tokens=2, min_gain_tokens=2)
    prompt = [1, 2, 3, 4]
    r = router.choose(prompt)
    router.release(r)
    router.mark_dead(r)
    assert router.holders(prompt) == []
    assert all(router.choose(prompt) == 1 - r for _ in range(3))
    router.mark_dead(1 - r)
    with pytest.raises(NoReplica):
        router.choose(prompt)
    router.revive(r)  # a restarted replica: routed to again, holding nothing yet
    assert router.alive[r] and router.holders(prompt) == []
    assert router.choose(prompt) == r


def test_the_prefix_map_is_bounded() -> None:
    router = PrefixRouter(2, block_tokens=1, max_blocks=10)
    for i in range(5):
        router.release(router.choose([i] * 8))
    assert len(router._holders) <= 10


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        PrefixRouter(0)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixRouter(1, block_tokens=0)
