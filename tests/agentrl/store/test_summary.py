"""The prompt/episode split behind the store's counts, previews and search text."""

from __future__ import annotations

from agentrl.store.summary import final_answer, prompt_layout, prompt_length, question, summarize
from agentrl.types import EpisodeError, ErrorClass, Message, ToolCall, Trajectory, Turn

DEMO = [
    Message("user", "Tom has 3 apples and buys 4 more. How many now?"),
    Message("assistant", "", tool_calls=[ToolCall("calculator", {"expression": "3 + 4"}, id="d0")]),
    Message("tool", "7", tool_call_id="d0", name="calculator"),
    Message("assistant", "Answer: 7"),
]


def _traj(messages: list[Message], turns: int, prompt: int | None) -> Trajectory:
    return Trajectory(
        task_id="t", env="calculator", messages=messages, token_ids=[], loss_mask=[], logprobs=[], versions=[],
        turns=[Turn(0, 0) for _ in range(turns)], prompt_messages=prompt,
    )  # fmt: skip


def _episode() -> list[Message]:
    return [
        Message("system", "Use the calculator tool."),
        *DEMO,
        Message("user", "Ivan has 42 marbles and loses 33. How many are left?"),
        Message("assistant", "", tool_calls=[ToolCall("calculator", {"expression": "42 - 33"}, id="c0")]),
        Message("tool", "9", tool_call_id="c0", name="calculator"),
        Message("assistant", "Answer: 9"),
    ]


def test_recorded_and_inferred_boundaries_agree() -> None:
    recorded, inferred = _traj(_episode(), 2, 6), _traj(_episode(), 2, None)
    assert prompt_length(recorded) == prompt_length(inferred) == 6
    for t in (recorded, inferred):
        layout = prompt_layout(t)
        assert (layout.system_end, layout.task_start, layout.prompt_end) == (1, 5, 6)
        assert question(t) == "Ivan has 42 marbles and loses 33. How many are left?"
        assert final_answer(t) == "Answer: 9"
        s = summarize(t)
        assert (s.num_turns, s.num_tool_calls, s.tools) == (2, 1, ["calculator"])
        assert s.preview == "Ivan has 42 marbles and loses 33. How many are left? ⟶ Answer: 9"
        assert "Tom" not in s.search_text and "Use the calculator" not in s.search_text
        assert "Ivan" in s.search_text and "42 - 33" in s.search_text


def test_no_turn_means_everything_was_prompt() -> None:
    t = _traj(_episode()[:6], 0, None)
    t.error = EpisodeError(ErrorClass.ENGINE, "engine down", turn=0)
    s = summarize(t)
    assert (s.num_turns, s.num_tool_calls, s.tools) == (0, 0, [])
    assert final_answer(t) == "" and s.preview == "Ivan has 42 marbles and loses 33. How many are left?"
    assert "engine down" in s.search_text and "Tom" not in s.search_text


def test_prompt_without_demonstrations_or_system() -> None:
    t = _traj([Message("user", "2+2?"), Message("assistant", "", tool_calls=[
        ToolCall("calculator", {"expression": "2+2"}, id="a")])], 1, 1)  # fmt: skip
    layout = prompt_layout(t)
    assert (layout.system_end, layout.task_start, layout.prompt_end) == (0, 0, 1)
    assert final_answer(t) == 'calculator({"expression": "2+2"})'  # a call-only reply shows the call
    assert summarize(t).preview == '2+2? ⟶ calculator({"expression": "2+2"})'


def test_a_recorded_boundary_past_the_end_is_clamped() -> None:
    t = _traj([Message("user", "q")], 0, 5)
    assert prompt_length(t) == 1 and summarize(t).num_turns == 0
