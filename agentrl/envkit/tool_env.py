"""`ToolEnv`: an env whose actions are tool calls on plain typed functions.

Each model reply is parsed by the configured parser (`tool_parser`). If it
holds tool calls, all of them run concurrently, each under its own timeout,
and every call gets a tool message back: the result, or an ``Error: ...``
the model can read (unknown tool, unparsable call, bad arguments, an
exception, a timeout, too many calls in one turn). A reply without tool calls
ends the episode (`terminated`) with the reward from `score(task, messages)`.
Turn and token limits are the rollout loop's (they set `truncated`).

Subclasses implement `tasks`, `initial_messages` and `score`; they may add a
per-turn reward by overriding `turn_reward`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import Field
from typing_extensions import TypeVar

from agentrl.chat.tool_parsers import ToolCallParser, get_parser
from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.rewards import RewardResult
from agentrl.tools import Tool, ToolOutcome, tool
from agentrl.types import Message, ToolCall


class ToolEnvConfig(EnvConfig):
    """Settings every tool env shares."""

    tool_parser: str = Field(
        "hermes", description="how tool calls are read from replies: hermes|llama3_json|json"
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="per-call limit (a tool's own timeout_s may be stricter)"
    )
    max_tool_calls_per_turn: int = Field(8, ge=1, description="calls past this in one reply are refused")
    tools_in_prompt: bool = Field(
        True,
        description="render the tool schemas into the prompt; false when the system prompt or "
        "demonstrations already show the calls (saves the template's schema boilerplate)",
    )


ToolConfigT = TypeVar("ToolConfigT", bound=ToolEnvConfig, default=ToolEnvConfig)
"""A tool env's config type: `ToolEnv[ToolConfigT]` (plain `ToolEnv`: `ToolEnv[ToolEnvConfig]`)."""


class ToolEnv(Env[ToolConfigT]):
    """Multi-turn tool use: run the calls of each reply, end on a reply without calls.

    Generic over its config like `Env`: `class MyEnv(ToolEnv[MyConfig])`.
    """

    Config: ClassVar[type[EnvConfig]] = ToolEnvConfig

    def __init__(
        self,
        config: ToolConfigT | None = None,
        *,
        tools: Sequence[Tool | Callable[..., Any]] | None = None,
        parser: ToolCallParser | None = None,
    ) -> None:
        super().__init__(config)
        if tools is not None:
            self.tools = [t if isinstance(t, Tool) else tool(t) for t in tools]
        names = [t.name for t in self.tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"{type(self).__name__}: duplicate tool names {duplicates}")
        self._tools_by_name = {t.name: t for t in self.tools}
        self.parser = parser if parser is not None else get_parser(self.config.tool_parser)
        self._task: Task | None = None
        self.history: list[Message] = []

    # -- to implement

    def initial_messages(self, task: Task) -> list[Message]:
        """The opening messages of an episode. Default: ``task["prompt"]`` as the user message."""
        return [Message(role="user", content=str(task["prompt"]))]

    async def score(self, task: Task, messages: Sequence[Message]) -> float | RewardResult:
        """The final reward for a finished episode; override in subclasses."""
        return 0.0

    async def turn_reward(self, action: Message, outcomes: Sequence[ToolOutcome]) -> float:
        """A reward for one tool-calling turn (default 0.0); goes to `StepResult.reward`."""
        return 0.0

    # -- the Env contract

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return (self.tool_schemas() or None) if self.config.tools_in_prompt else None

    def parse_action(self, text: str) -> Message:
        parsed = self.parser.parse(text)
        return Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self._task = task
        self.history = self.initial_messages(task)
        return list(self.history), {}

    async def step(self, action: Message) -> StepResult:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        self.history.append(action)
        if not action.tool_calls:
            result = await self.score(self._task, self.history)
            if isinstance(result, RewardResult):
                info: dict[str, Any] = {"reward_info": result.info} if result.info else {}
                return StepResult(
                    messages=[], reward=result.value, terminated=True, info=info, reward_breakdown=result.breakdown
                )
            return StepResult(messages=[], reward=float(result), terminated=True)
        limit = self.config.max_tool_calls_per_turn
        allowed, refused = action.tool_calls[:limit], action.tool_calls[limit:]
        outcomes = list(await asyncio.gather(*(self.run_call(c) for c in allowed)))
        outcomes += [
            ToolOutcome(
                f"Error: too many tool calls in one turn (max {limit}); this call was not run", "arguments"
            )
            for _ in refused
        ]
        messages = [
            Message(role="tool", content=o.content, tool_call_id=c.id, name=c.name or None)
            for c, o in zip(action.tool_calls, outcomes, strict=True)
        ]
        self.history.extend(messages)
        reward = await self.turn_reward(action, outcomes)
        return StepResult(
            messages=messages,
            reward=reward,
            info={"tool_calls": len(action.tool_calls)},
            tool_errors=sum(not o.ok for o in outcomes),
            tool_timeouts=sum(o.error == "timeout" for o in outcomes),
        )

    async def run_call(self, call: ToolCall) -> ToolOutcome:
        """One call -> its outcome; never raises."""
        if call.error is not None:
            return ToolOutcome(f"Error: could not read the tool call: {call.error}", "arguments")
        found = self._tools_by_name.get(call.name)
        if found is None:
            available = ", ".join(self._tools_by_name) or "(none)"
            return ToolOutcome(
                f"Error: unknown tool '{call.name}'. Available tools: {available}", "arguments"
            )
        return await found.run(call.arguments, timeout_s=self.config.tool_timeout_s)
