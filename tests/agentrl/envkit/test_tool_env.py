"""ToolEnv: concurrent calls, per-call timeouts, errors as tool messages, scoring."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import pytest

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envkit.tool_env import ToolEnv, ToolEnvConfig
from agentrl.tools import ToolOutcome, tool
from agentrl.types import Message, ToolCall


@tool(timeout_s=5.0)
async def wait(seconds: float) -> str:
    """Sleep, then say how long."""
    await asyncio.sleep(seconds)
    return f"waited {seconds}"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(reason)


class AddEnv(ToolEnv):
    """Answer = a + b; reward 1 when the final reply ends with it."""

    tools = (add, wait, explode)

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return [{"id": "t0", "prompt": "2+3?", "answer": 5}]

    async def score(self, task: Task, messages: Sequence[Message]) -> float | RewardResult:
        ok = messages[-1].content.strip().endswith(str(task["answer"]))
        return RewardResult(value=float(ok), breakdown={"correct": float(ok)}, info={"seen": len(messages)})

    async def turn_reward(self, action: Message, outcomes: Sequence[ToolOutcome]) -> float:
        return -0.1 * sum(not o.ok for o in outcomes)


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name=name, arguments=dict(arguments))


async def started(env: ToolEnv) -> ToolEnv:
    messages, info = await env.reset(next(iter(env.tasks())))
    assert messages == [Message("user", "2+3?")] and info == {}
    return env


async def test_episode_with_tool_then_answer() -> None:
    env = await started(AddEnv())
    action = env.parse_action('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    result = await env.step(action)
    assert not result.terminated and not result.truncated
    (msg,) = result.messages
    assert msg.role == "tool" and msg.content == "5" and msg.tool_call_id == action.tool_calls[0].id
    assert msg.name == "add"
    assert result.info == {"tool_calls": 1} and result.tool_errors == 0 and result.tool_timeouts == 0 and result.reward == 0.0
    final = await env.step(env.parse_action("Answer: 5"))
    assert final.terminated and final.messages == [] and final.reward == 1.0
    assert final.reward_breakdown == {"correct": 1.0} and final.info["reward_info"] == {"seen": 4}


async def test_calls_run_concurrently_each_under_its_timeout() -> None:
    env = await started(AddEnv(ToolEnvConfig(tool_timeout_s=0.3)))
    action = Message(
        "assistant",
        "",
        tool_calls=[call("wait", seconds=0.2), call("wait", seconds=0.2), call("wait", seconds=3)],
    )
    result = await env.step(action)
    contents = [m.content for m in result.messages]
    assert contents[:2] == ["waited 0.2", "waited 0.2"]
    assert contents[2] == "Error: tool 'wait' timed out after 0.3s"
    assert result.tool_timeouts == 1 and result.tool_errors == 1
    assert result.reward == pytest.approx(-0.1)


async def test_calls_of_a_turn_overlap() -> None:
    arrived = 0
    both_here = asyncio.Event()

    @tool(timeout_s=5.0)
    async def meet(who: str) -> str:
        """Wait until both callers are inside: only possible if they run at the same time."""
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            both_here.set()
        await both_here.wait()
        return f"{who} met"

    env = await started(AddEnv(tools=[meet]))
    result = await env.step(
        Message("assistant", "", tool_calls=[call("meet", who="a"), call("meet", who="b")])
    )
    assert [m.content for m in result.messages] == ["a met", "b met"]


async def test_every_failure_is_a_readable_tool_message() -> None:
    env = await started(AddEnv())
    action = env.parse_action(
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "explode", "arguments": {"reason": "boom"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, </tool_call>'
    )
    result = await env.step(action)
    contents = [m.content for m in result.messages]
    assert contents[0] == "Error: unknown tool 'nope'. Available tools: add, wait, explode"
    assert contents[1].startswith("Error: invalid arguments for tool 'add': a:")
    assert "missing required argument 'b'" in contents[2]
    assert contents[3] == "Error: tool 'explode' raised RuntimeError: boom"
    assert contents[4].startswith("Error: could not read the tool call: the tool call is not valid JSON")
    assert result.tool_errors == 5 and not result.terminated
    assert [m.tool_call_id for m in result.messages] == [c.id for c in action.tool_calls]


async def test_too_many_calls_are_refused_not_run() -> None:
    ran: list[int] = []

    @tool(threaded=False)
    def note(i: int) -> str:
        """Record i."""
        ran.append(i)
        return "ok"

    env = await started(AddEnv(ToolEnvConfig(max_tool_calls_per_turn=2), tools=[note]))
    result = await env.step(Message("assistant", "", tool_calls=[call("note", i=i) for i in range(4)]))
    assert ran == [0, 1]
    assert [m.content for m in result.messages][:2] == ["ok", "ok"]
    assert all("too many tool calls in one turn (max 2)" in m.content for m in result.messages[2:])


async def test_plain_float_score_and_default_initial_messages() -> None:
    class Plain(ToolEnv):
        def tasks(self, split: str = "train") -> Iterable[Task]:
            return [{"id": "x", "prompt": "hi"}]

        async def score(self, task: Task, messages: Sequence[Message]) -> float:
            return 0.25

    env = Plain(tools=[add])
    assert env.tool_schemas()[0]["function"]["name"] == "add"
    await env.reset({"id": "x", "prompt": "hi"})
    result = await env.step(env.parse_action("no tools here"))
    assert result.terminated and result.reward == 0.25 and result.info == {}


async def test_step_before_reset_and_duplicate_tools() -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        await AddEnv().step(Message("assistant", "x"))
    with pytest.raises(ValueError, match="duplicate tool names"):
        AddEnv(tools=[add, add])


def test_config_validation_and_parser_choice() -> None:
    with pytest.raises(ValueError, match="unknown tool_parser"):
        AddEnv(ToolEnvConfig(tool_parser="xml"))
    with pytest.raises(ValueError, match="extra"):
        ToolEnvConfig(tool_parsr="hermes")  # type: ignore[call-arg]
    env = AddEnv(ToolEnvConfig(tool_parser="llama3_json"))
    msg = env.parse_action('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert msg.tool_calls[0].arguments == {"a": 1, "b": 2}


async def test_tools_in_prompt_false_keeps_schemas_out_of_the_prompt_but_runs_calls() -> None:
    from agentrl.chat.conversation import SimpleChatTokenizer
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.manager import run_episode

    assert [s["function"]["name"] for s in AddEnv().prompt_tools() or []] == ["add", "wait", "explode"]
    hidden = AddEnv(ToolEnvConfig(tools_in_prompt=False))
    assert hidden.prompt_tools() is None and len(hidden.tool_schemas()) == 3

    tokenizer = SimpleChatTokenizer()
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "Answer: 5"]
    engine = ScriptedEngine(ScriptedEngine.Config(replies=replies), tokenizer=tokenizer)
    task = next(iter(hidden.tasks()))
    shown = await run_episode(AddEnv(), task, engine, tokenizer, RolloutConfig(max_turns=3))
    bare = await run_episode(hidden, task, engine, tokenizer, RolloutConfig(max_turns=3))
    await engine.close()
    assert '"explode"' in tokenizer.decode(shown.token_ids)
    assert '"explode"' not in tokenizer.decode(bare.token_ids)
    assert bare.reward == shown.reward == 1.0  # the call still ran: the tool is known, just not described
