"""What a trajectory's list row and search index say: its prompt vs its episode.

A trajectory's `messages` start with the prompt the episode was given (the
env's opening: a system prompt, maybe few-shot demonstrations, then the task)
and go on with the episode itself (each model turn and what the env or its
tools answered). Only the episode is the policy's doing, so the store counts,
previews and indexes for search from it:

- `num_turns` and `num_tool_calls` count the episode's model turns and calls,
  the same numbers as the rollout's metrics (`rollout/turns_mean`, ...);
- the preview is the task's question and the model's final answer;
- full-text search covers the task's question and the episode, never the
  system prompt or the demonstrations (they are the same in every trajectory).

`Trajectory.prompt_messages` records where the prompt ends. Trajectories
stored before it existed are read by inference (`prompt_length`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentrl.types import Message, Trajectory

PREVIEW_CHARS = 160


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """Where the parts of a trajectory's messages lie (each a half-open index range).

    `messages[:system_end]`: leading system messages; `[system_end:task_start]`:
    few-shot demonstrations (empty when there are none); `[task_start:prompt_end]`:
    the task's opening; `[prompt_end:]`: the episode.
    """

    system_end: int
    task_start: int
    prompt_end: int

    def to_dict(self) -> dict[str, int]:
        return {"system_end": self.system_end, "task_start": self.task_start, "prompt_end": self.prompt_end}


def prompt_length(traj: Trajectory) -> int:
    """How many leading messages were the prompt.

    The recorded `Trajectory.prompt_messages` when there is one. Otherwise
    (older trajectories) inferred from the rollout's shape: every model turn
    appended exactly one assistant message, so the episode starts at the
    assistant message of the first of the `len(turns)` turns, which are the
    last ones; with no turn at all every message was the prompt.
    """
    n = len(traj.messages)
    if traj.prompt_messages is not None:
        return max(0, min(traj.prompt_messages, n))
    if not traj.turns:
        return n
    assistants = [i for i, m in enumerate(traj.messages) if m.role == "assistant"]
    if len(assistants) < len(traj.turns):  # not the rollout's shape: the first assistant message starts it
        return assistants[0] if assistants else n
    return assistants[-len(traj.turns)]


def prompt_layout(traj: Trajectory) -> PromptLayout:
    """Split the prompt into system messages, demonstrations and the task's opening.

    Demonstrations are the messages after the leading system ones up to the
    last assistant or tool message of the prompt (a worked example ends with
    the model's answer); what follows is the task.
    """
    end = prompt_length(traj)
    messages = traj.messages
    system_end = 0
    while system_end < end and messages[system_end].role == "system":
        system_end += 1
    task_start = system_end
    for i in range(end - 1, system_end - 1, -1):
        if messages[i].role in ("assistant", "tool"):
            task_start = i + 1
            break
    return PromptLayout(system_end, task_start, end)


def episode_messages(traj: Trajectory) -> list[Message]:
    """The messages of the episode itself (after the prompt)."""
    return traj.messages[prompt_length(traj) :]


def question(traj: Trajectory) -> str:
    """The task's question: the user text of the task's opening."""
    layout = prompt_layout(traj)
    parts = [m.content for m in traj.messages[layout.task_start : layout.prompt_end] if m.role == "user"]
    return "\n".join(parts)


def final_answer(traj: Trajectory) -> str:
    """The model's last message of the episode ("" when it took no turn).

    A message with only tool calls shows them as `name(arguments)`.
    """
    for m in reversed(episode_messages(traj)):
        if m.role != "assistant":
            continue
        calls = " ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in m.tool_calls)
        return m.content if m.content.strip() else calls
    return ""


@dataclass(frozen=True, slots=True)
class RowSummary:
    """The list-row columns the store derives from a trajectory."""

    num_turns: int
    num_tool_calls: int
    tools: list[str]
    preview: str
    search_text: str


def summarize(traj: Trajectory) -> RowSummary:
    """Counts, tools used, preview and search text, from the episode only."""
    episode = episode_messages(traj)
    calls = [c for m in episode for c in m.tool_calls]
    asked, answer = _cut(question(traj)), _cut(final_answer(traj))
    preview = asked + (" ⟶ " + answer if answer else "")
    parts = [question(traj)]
    for m in episode:
        parts.append(m.content)
        for c in m.tool_calls:
            parts.append(c.name)
            parts.append(json.dumps(c.arguments, ensure_ascii=False))
    if traj.error:
        parts.append(traj.error.message)
    return RowSummary(
        num_turns=sum(1 for m in episode if m.role == "assistant"),
        num_tool_calls=len(calls),
        tools=sorted({c.name for c in calls}),
        preview=preview,
        search_text="\n".join(parts),
    )


def _cut(text: str, limit: int = PREVIEW_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
