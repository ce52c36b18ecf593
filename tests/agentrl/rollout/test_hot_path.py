"""The rollout hot path's shortcuts give exactly what the plain computations give.

Covers the per-call deadlines of `run_episode`, `Sampling.for_turn`, SimpleChatTokenizer.encode,
the Conversation's memoised deltas and turn endings, the trajectory run_episode builds
and the cheaper version scans on trajectories and groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.chat.conversation import Conversation, SimpleChatTokenizer, closing_remainder
from agentrl.engines.base import Sampling
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import StepResult
from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig
from agentrl.rollout.episode import run_episode
from agentrl.types import Completion, ErrorClass, Group, Message, Trajectory, new_id

# -- per-call deadlines -------------------------------------------------------------------


class _SlowStep(TrivialEnv):
    """Steps that take `delay_s`; `swallow` makes the first one swallow its cancellation (bad code)."""

    def __init__(self, delay_s: float, swallow: bool = False) -> None:
        super().__init__(TrivialEnvConfig(turns=3))
        self.delay_s, self.swallow = delay_s, swallow

    async def step(self, action: Message) -> StepResult:
        if self.swallow:
            self.swallow = False
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(self.delay_s)
        else:
            await asyncio.sleep(self.delay_s)
        return await super().step(action)


async def _episode(env: TrivialEnv, **config: float) -> Trajectory:
    from agentrl.rollout.config import RolloutConfig

    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    return await run_episode(env, {"id": "a", "prompt": "go"}, engine, tok, RolloutConfig.model_validate(config))


async def test_a_blocking_call_past_its_deadline_is_a_classified_timeout() -> None:
    traj = await _episode(_SlowStep(10.0), env_timeout_s=0.02)
    assert traj.error is not None and traj.error.kind is ErrorClass.TIMEOUT
    assert traj.error.message == "env.step timed out after 0.02s" and traj.error.turn == 1
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_the_episode_deadline_caps_every_call() -> None:
    traj = await _episode(_SlowStep(10.0), env_timeout_s=60.0, episode_timeout_s=0.03)
    assert traj.error is not None and traj.error.kind is ErrorClass.TIMEOUT
    assert traj.error.message == "episode exceeded episode_timeout_s=0.03"


async def test_a_swallowed_deadline_cancellation_still_ends_the_episode_as_a_timeout() -> None:
    traj = await _episode(_SlowStep(0.2, swallow=True), env_timeout_s=0.02)
    assert traj.error is not None and traj.error.kind is ErrorClass.TIMEOUT
    assert traj.error.message == "env.step timed out after 0.02s"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_failing_call_is_classified_with_its_default_class() -> None:
    class Broken(TrivialEnv):
        async def step(self, action: Message) -> StepResult:
            raise KeyError("x")

    traj = await _episode(Broken(TrivialEnvConfig(turns=2)))
    assert traj.error is not None and traj.error.kind is ErrorClass.ENV
    assert traj.error.message.startswith("env.step failed: KeyError")


async def test_a_cancellation_from_outside_propagates_unchanged() -> None:
    env = _SlowStep(3600.0)
    job = asyncio.create_task(_episode(env, env_timeout_s=60.0))
    await asyncio.sleep(0.05)  # the episode now sits in its first env.step
    assert not job.done()
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job


# -- sampling -----------------------------------------------------------------------------


def test_for_turn_equals_a_freshly_built_sampling() -> None:
    template = Sampling(max_tokens=32, temperature=0.7, top_p=0.9, top_k=5, stop_ids=(1, 2), stop_strings=("x",), seed=1)
    derived = template.for_turn(7, 99)
    assert derived == Sampling(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, stop_ids=(1, 2),
                               stop_strings=("x",), seed=99)
    assert type(derived) is Sampling and template.seed == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        derived.seed = 3  # type: ignore[misc]
    assert template.for_turn(7, None).seed is None
    with pytest.raises(ValueError, match="max_tokens"):
        template.for_turn(0, 1)


# -- the simple tokenizer -----------------------------------------------------------------

SPECIALS = SimpleChatTokenizer.SPECIAL_TOKENS
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


def reference_encode(text: str) -> list[int]:
    """Split at special tokens left to right; bytes elsewhere (the tokenizer's definition)."""
    out: list[int] = []
    for i, piece in enumerate(_SPLIT.split(text)):
        if i % 2:
            out.append(256 + SPECIALS.index(piece))
        else:
            out += piece.encode("utf-8")
    return out


FRAGMENTS = [*SPECIALS, "<|", "|>", "<|im_", "start|>", "end|>", "<", "|", "\n", "é", "漢", "😀", "\xf8", "\u0100", "ÿ"]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(string.printable, max_size=5)), max_size=20).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_simple_encode_matches_the_split_definition(text: str) -> None:
    tok = SimpleChatTokenizer()
    assert tok.encode(text) == reference_encode(text)
    assert tok.encode(text) == reference_encode(text)  # again, from the cache
    assert tok.decode(tok.encode(text)) == text


def test_simple_encode_of_long_texts_and_cache_copies() -> None:
    tok = SimpleChatTokenizer()
    text = "".join(f"<|im_start|>user\n{i} é<|im_end|>\n" for i in range(200))
    assert tok.encode(text) == reference_encode(text)
    short = "<|im_start|>assistant\n"
    first = tok.encode(short)
    first.append(0)  # callers may change what they get
    assert tok.encode(short) == reference_encode(short)


# -- conversation memos ---------------------------------------------------------------------


def _completion(tok: SimpleChatTokenizer, text: str, *, eos: bool = True) -> Completion:
    ids = tok.encode(text) + ([tok.im_end_id] if eos else [])
    return Completion(ids, [-0.5] * len(ids), [3] * len(ids), "stop" if eos else "length")


def _play(tok: SimpleChatTokenizer, replies: list[tuple[str, bool]], env_texts: list[str]) -> Conversation:
    conv = Conversation(tok, [Message(role="system", content="s"), Message(role="user", content="go")])
    for (reply, eos), env_text in zip(replies, env_texts, strict=True):
        conv.add_completion(_completion(tok, reply, eos=eos), Message(role="assistant", content=reply))
        reply_msg = (
            Message(role="tool", content=env_text, tool_call_id="c1")
            if env_text.startswith("T:")
            else Message(role="user", content=env_text)
        )
        assert conv.add_messages([reply_msg])
    return conv


def test_memoised_deltas_and_endings_give_the_same_ids_as_fresh_ones() -> None:
    replies = [("Fine.", True), ("cut", False), ("Fine.", True), ("stop<|im_end|>", False)]
    env_texts = ["ok", "ok", "T:result", "ok"]
    shared = SimpleChatTokenizer()
    first = _play(shared, replies, env_texts)
    second = _play(shared, replies, env_texts)  # every delta and ending now comes from the memos
    facts = shared.boundary_cache[""]
    assert facts.deltas and facts.remainders
    for conv in (first, second):
        fresh = _play(SimpleChatTokenizer(), replies, env_texts)
        assert conv.token_ids == fresh.token_ids and conv.loss_mask == fresh.loss_mask
        assert conv.logprobs == fresh.logprobs and conv.versions == fresh.versions
        assert conv.retokenization_drift() == fresh.retokenization_drift() > 0.0  # the last reply drifts
        assert conv.num_sampled == sum(conv.loss_mask)
    clean = _play(shared, replies[:3], env_texts[:3])
    assert clean.token_ids == shared.encode(shared.render(clean.messages, add_generation_prompt=True))
    # the memos are not aliased by the conversations
    second.token_ids.clear()
    assert _play(shared, replies, env_texts).token_ids == first.token_ids


@pytest.mark.parametrize("sampled", [[], [5], [5, 258], [258], [5, 257], [257, 10], [10, 257, 10]])
def test_memoised_closing_remainder(sampled: list[int]) -> None:
    tok = SimpleChatTokenizer()
    conv = Conversation(tok, [Message(role="user", content="go")])
    closing = conv._template_facts().closing
    completion = Completion(sampled, [0.0] * len(sampled), [0] * len(sampled), "length")
    conv.add_completion(completion, Message(role="assistant", content=""))
    assert conv._pending_close == closing_remainder(sampled, closing, tok.eos_ids)
    again = Conversation(tok, [Message(role="user", content="go")])
    again.add_completion(completion, Message(role="assistant", content=""))
    assert again._pending_close == closing_remainder(sampled, closing, tok.eos_ids)


async def test_run_episode_trajectory_equals_the_conversation_built_by_hand() -> None:
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.manager import run_episode

    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["Fine."]), tokenizer=tok)
    config = RolloutConfig.model_validate({})
    traj = await run_episode(TrivialEnv(TrivialEnvConfig(turns=3)), {"id": "a", "prompt": "go"}, engine, tok,
                             config, seed=5)
    conv = Conversation(tok, [Message(role="user", content="go")])
    for i in range(3):
        ids = [*tok.encode("Fine."), tok.im_end_id]
        conv.add_completion(Completion(ids, [-1.0] * 6, [0] * 6, "stop"), Message(role="assistant", content="Fine."))
        if i < 2:
            assert conv.add_messages([Message(role="user", content="ok")])
    expected = conv.to_trajectory(task_id="a", env="trivial")
    assert traj.error is None and traj.terminated and traj.reward == 1.0
    assert traj.token_ids == expected.token_ids and traj.loss_mask == expected.loss_mask
    assert traj.logprobs == expected.logprobs and traj.versions == expected.versions
    assert [m.to_dict() for m in traj.messages] == [m.to_dict() for m in expected.messages]
    assert [t.to_dict() for t in traj.turns] == [
        {**t.to_dict(), "reward": 1.0 if k == 2 else 0.0} for k, t in enumerate(expected.turns)
    ]
    assert traj.metrics["retokenization_drift"] == expected.metrics["retokenization_drift"] == 0.0
    assert traj.metrics["sampled_tokens"] == 18.0


# -- trajectory and group version scans -----------------------------------------------------


def _traj(versions: list[int], mask: list[int]) -> Trajectory:
    n = len(versions)
    return Trajectory("t", "e", [], list(range(n)), mask, [0.0] * n, versions)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 9), st.sampled_from([0, 1])), max_size=30))
def test_version_scans_match_the_definition(pairs: list[tuple[int, int]]) -> None:
    versions, mask = [v for v, _ in pairs], [m for _, m in pairs]
    traj = _traj(versions, mask)
    sampled = [v for v, m in pairs if m]
    assert traj.policy_versions == ((min(sampled), max(sampled)) if sampled else None)
    assert traj.oldest_version == (min(sampled) if sampled else None)
    group = Group("t", [traj, _traj([7, 4], [1, 0])])
    assert group.oldest_version == min([*sampled, 7])


def test_version_scans_refuse_misaligned_lists() -> None:
    traj = _traj([1, 2], [1, 1])
    traj.loss_mask.append(1)
    with pytest.raises(ValueError, match="differ in length"):
        _ = traj.policy_versions
    with pytest.raises(ValueError, match="differ in length"):
        _ = Group("t", [traj]).oldest_version


def test_new_ids_are_16_hex_digits_and_distinct() -> None:
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch("[0-9a-f]{16}", i) for i in ids)


# -- trivial env ----------------------------------------------------------------------------


async def test_trivial_env_counts_its_steps() -> None:
    env = TrivialEnv(TrivialEnvConfig(turns=3))
    for _ in range(2):
        await env.reset({"id": "a", "prompt": "go"})
        results = [await env.step(Message(role="assistant", content="x")) for _ in range(3)]
        assert [r.terminated for r in results] == [False, False, True] and results[-1].reward == 1.0
    assert env.steps == 6


def test_memoised_multi_message_deltas() -> None:
    def play(tok: SimpleChatTokenizer) -> list[int]:
        conv = Conversation(tok, [Message(role="user", content="go")])
        for _ in range(3):
            conv.add_completion(_completion(tok, "Fine."), Message(role="assistant", content="Fine."))
            assert conv.add_messages([
                Message(role="tool", content="4", tool_call_id="a"),
                Message(role="user", content="ok"),
            ])
            conv.add_completion(_completion(tok, "Fine."), Message(role="assistant", content="Fine."))
            assert conv.add_messages([Message(role="tool", content="4", tool_call_id="a")])
        return conv.token_ids

    shared = SimpleChatTokenizer()
    first, second = play(shared), play(shared)
    assert first == second == play(SimpleChatTokenizer())
    assert len(shared.boundary_cache[""].deltas) == 2
