"""Hypothesis strategies for core types, shared by the store and types tests."""

from __future__ import annotations

from hypothesis import strategies as st

from agentrl.types import EpisodeError, ErrorClass, Message, ToolCall, Trajectory, Turn

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=8),
                      st.floats(allow_nan=False, allow_infinity=False))  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
json_dict = st.dictionaries(st.text(max_size=6), json_value, max_size=3)
any_float = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    n = draw(st.integers(0, 40))
    calls = st.builds(
        ToolCall,
        name=st.text(min_size=1, max_size=8),
        arguments=json_dict,
        id=st.text(min_size=1, max_size=8),
        error=st.none() | st.text(max_size=10),
    )
    message = st.builds(
        Message,
        role=st.sampled_from(["system", "user", "assistant", "tool"]),
        content=st.text(max_size=60),
        tool_calls=st.lists(calls, max_size=2),
        tool_call_id=st.none() | st.text(max_size=8),
        name=st.none() | st.text(max_size=8),
    )
    turns = st.builds(
        Turn,
        start=st.integers(0, 100),
        end=st.integers(0, 100),
        reward=any_float,
        tool_calls=st.lists(st.text(max_size=5), max_size=2),
        info=json_dict,
    )
    error = st.none() | st.builds(
        EpisodeError,
        kind=st.sampled_from(list(ErrorClass)),
        message=st.text(max_size=20),
        turn=st.none() | st.integers(0, 9),
    )
    return Trajectory(
        task_id=draw(st.text(max_size=10)),
        env=draw(st.text(max_size=10)),
        messages=draw(st.lists(message, max_size=5)),
        token_ids=draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        logprobs=draw(st.lists(any_float, min_size=n, max_size=n)),
        versions=draw(st.lists(st.integers(-1, 2**31), min_size=n, max_size=n)),
        turns=draw(st.lists(turns, max_size=3)),
        reward=draw(any_float),
        reward_breakdown=draw(st.dictionaries(st.text(max_size=5), any_float, max_size=3)),
        terminated=draw(st.booleans()),
        truncated=draw(st.booleans()),
        truncation_reason=draw(st.none() | st.text(max_size=8)),
        error=draw(error),
        group_id=draw(st.text(max_size=8)),
        sample_index=draw(st.integers(0, 64)),
        seed=draw(st.none() | st.integers(-(2**62), 2**62)),
        task=draw(json_dict),
        metrics=draw(st.dictionaries(st.text(max_size=5), any_float, max_size=3)),
        info=draw(json_dict),
    )
