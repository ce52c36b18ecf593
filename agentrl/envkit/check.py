"""`check_env`: check an env against the agentrl contract, like gymnasium's env_checker.

It drives a few short episodes with a trivial policy and collects every
problem it finds (rather than stopping at the first), then raises one
`EnvCheckError` listing them all. What it checks:

- the class: an `Env` subclass with async `reset`/`step`/`close` and a pydantic
  `Config` that forbids unknown keys;
- `tasks(split)`: JSON-able dicts with a unique "id", in a deterministic order;
- `tools`: valid OpenAI function schemas with unique names;
- `reset(task, seed=...)`: `(list[Message], dict)`, the same messages for the same seed;
- `step(action)`: a `StepResult` with `bool` terminated/truncated, a finite float
  reward, non-assistant messages, a dict info and well-typed signals
  (`reward_breakdown`, `truncation_reason`, `tool_errors`, `tool_timeouts`;
  a warning when `info` still carries those names);
- `close()`: may be called twice.

Every call runs under a deadline, so a hanging env is reported, not waited on.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from agentrl.env import Env, StepResult, Task
from agentrl.errors import AgentrlError
from agentrl.types import Message, ToolCall

T = TypeVar("T")
Policy = Callable[[Sequence[Message]], str]

_ROLES = ("system", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_TASKS_CHECKED = 64


class EnvCheckError(AgentrlError):
    """The env breaks the contract; `problems` lists every finding."""

    def __init__(self, env_name: str, problems: Sequence[str]) -> None:
        self.env_name = env_name
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"env {env_name!r} fails {len(self.problems)} check(s):\n{lines}")


@dataclass(slots=True)
class EnvCheckReport:
    """What a passing check saw (warnings are suspicious but allowed)."""

    env: str
    episodes: int = 0
    steps: int = 0
    tasks_checked: int = 0
    warnings: list[str] = field(default_factory=list)


def default_policy(messages: Sequence[Message]) -> str:
    """A policy that knows nothing: the env must cope with any reply."""
    return "I don't know."


class _Checker:
    def __init__(self, env: Env, timeout_s: float) -> None:
        self.env = env
        self.name = getattr(env, "name", "") or type(env).__name__
        self.timeout_s = timeout_s
        self.problems: list[str] = []
        self.report = EnvCheckReport(env=self.name)

    def problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def warn(self, text: str) -> None:
        if text not in self.report.warnings:
            self.report.warnings.append(text)

    async def call(self, what: str, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
        """Await under the deadline; a raise or a timeout becomes a problem."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return True, await awaitable
        except TimeoutError:
            self.problem(f"{what} did not return within {self.timeout_s:g}s")
        except Exception as e:
            self.problem(f"{what} raised {type(e).__name__}: {e}")
        return False, None

    # ------------------------------------------------------------------ static checks

    def check_class(self) -> None:
        cls = type(self.env)
        for method in ("reset", "step", "close"):
            if not inspect.iscoroutinefunction(getattr(cls, method, None)):
                self.problem(f"{cls.__name__}.{method} must be an async method (async def)")
        config_cls = getattr(cls, "Config", None)
        if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
            self.problem(f"{cls.__name__}.Config must be a pydantic model (subclass agentrl.EnvConfig)")
            return
        if config_cls.model_config.get("extra") != "forbid":
            self.problem(f"{cls.__name__}.Config must forbid unknown keys (model_config extra='forbid')")
        if not isinstance(getattr(self.env, "config", None), config_cls):
            self.problem(f"env.config is not a {config_cls.__name__} (call super().__init__(config))")

    def check_tools(self) -> None:
        tools = getattr(self.env, "tools", ())
        if not isinstance(tools, Sequence) or isinstance(tools, str):
            self.problem(f"env.tools must be a sequence of Tool objects, got {type(tools).__name__}")
            return
        names: list[str] = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            try:
                schema = tool.schema()
            except Exception as e:
                self.problem(f"{where}.schema() raised {type(e).__name__}: {e}")
                continue
            self._check_tool_schema(where, getattr(tool, "name", None), schema)
            names.append(str(getattr(tool, "name", "")))
        for name in sorted({n for n in names if names.count(n) > 1}):
            self.problem(f"tool name {name!r} is used by more than one tool")

    def _check_tool_schema(self, where: str, name: Any, schema: Any) -> None:
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            self.problem(f"{where}.name {name!r} must match {_TOOL_NAME.pattern}")
        if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(
            schema.get("function"), dict
        ):
            self.problem(f"{where}.schema() must be {{'type': 'function', 'function': {{...}}}}, got {schema!r}")
            return
        fn = schema["function"]
        if fn.get("name") != name:
            self.problem(f"{where}.schema() function name {fn.get('name')!r} differs from tool.name {name!r}")
        if not isinstance(fn.get("description"), str) or not fn["description"].strip():
            self.warn(f"{where} ({name}) has no description: the model cannot know what it does")
        params = fn.get("parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            self.problem(f"{where} ({name}) parameters must be a JSON schema of type 'object', got {params!r}")
            return
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            self.problem(f"{where} ({name}) parameters.properties must map names to JSON schemas")
            return
        required = params.get("required", [])
        missing = [r for r in required if r not in props] if isinstance(required, list) else ["(not a list)"]
        if missing:
            self.problem(f"{where} ({name}) parameters.required names unknown properties: {missing}")
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            self.problem(f"{where} ({name}) schema is not JSON-serialisable: {e}")

    def check_tasks(self, tasks: Iterable[Task] | None, split: str, n_episodes: int) -> list[Task]:
        given = tasks is not None
        try:
            source = tasks if given else self.env.tasks(split)
            assert source is not None
            sample = list(itertools.islice(iter(source), max(n_episodes, _MAX_TASKS_CHECKED)))
        except Exception as e:
            self.problem(f"tasks({split!r}) raised {type(e).__name__}: {e}")
            return []
        if not sample:
            self.problem(f"tasks({split!r}) yielded no tasks")
            return []
        ids: list[Any] = []
        for i, task in enumerate(sample):
            if not isinstance(task, dict):
                self.problem(f"task #{i} is a {type(task).__name__}, not a dict")
                continue
            if "id" not in task:
                self.problem(f"task #{i} has no 'id' key (keys: {sorted(task)[:8]})")
            elif not isinstance(task["id"], str | int) or isinstance(task["id"], bool):
                self.problem(f"task #{i} id {task['id']!r} must be a str or int")
            else:
                ids.append(task["id"])
            try:
                json.dumps(task)
            except (TypeError, ValueError) as e:
                self.problem(f"task #{i} ({task.get('id')!r}) is not JSON-serialisable: {e}")
        duplicates = sorted({str(i) for i in ids if ids.count(i) > 1})
        if duplicates:
            self.problem(f"task ids are not unique: {duplicates[:5]}")
        if not given:
            try:
                again = list(itertools.islice(iter(self.env.tasks(split)), len(sample)))
                if again != sample:
                    self.problem(f"tasks({split!r}) is not deterministic: two calls gave different tasks")
            except Exception as e:
                self.problem(f"tasks({split!r}) raised {type(e).__name__} on a second call: {e}")
        self.report.tasks_checked = len(sample)
        return [t for t in sample if isinstance(t, dict)]

    def check_parse_action(self) -> None:
        try:
            message = self.env.parse_action("Hello.")
        except Exception as e:
            self.problem(f"parse_action('Hello.') raised {type(e).__name__}: {e}")
            return
        if not isinstance(message, Message) or message.role != "assistant":
            self.problem(f"parse_action must return an assistant Message, got {message!r}")

    # ------------------------------------------------------------------ dynamic checks

    def check_messages(self, what: str, messages: Any, *, from_env: bool) -> bool:
        if not isinstance(messages, list):
            self.problem(f"{what} messages must be a list[Message], got {type(messages).__name__}")
            return False
        ok = True
        for i, m in enumerate(messages):
            if not isinstance(m, Message):
                self.problem(f"{what} message #{i} is a {type(m).__name__}, not an agentrl Message")
                ok = False
            elif m.role not in _ROLES:
                self.problem(f"{what} message #{i} has role {m.role!r}; allowed: {', '.join(_ROLES)}")
                ok = False
            elif from_env and m.role == "assistant" and (not what.startswith("reset") or i == len(messages) - 1):
                # reset may hold few-shot demonstration turns, but the model must speak next
                self.problem(
                    f"{what} message #{i} has role 'assistant': env messages are system/user/tool"
                    + (" (reset may include demonstration turns, but must not end on one)" if what.startswith("reset") else "")
                )
                ok = False
            elif not isinstance(m.content, str):
                self.problem(f"{what} message #{i} content must be str, got {type(m.content).__name__}")
                ok = False
            elif not all(isinstance(c, ToolCall) for c in m.tool_calls):
                self.problem(f"{what} message #{i} tool_calls must be ToolCall objects")
                ok = False
        return ok

    def check_info(self, what: str, info: Any) -> None:
        if not isinstance(info, dict):
            self.problem(f"{what} info must be a dict, got {type(info).__name__}")
            return
        try:
            json.dumps(info)
        except (TypeError, ValueError):
            self.warn(f"{what} info is not JSON-serialisable (it cannot be stored with the trajectory)")

    async def reset(self, task: Task, seed: int) -> list[Message] | None:
        what = f"reset(task {task.get('id')!r}, seed={seed})"
        ok, result = await self.call(what, self.env.reset(task, seed=seed))
        if not ok:
            return None
        if not (isinstance(result, tuple) and len(result) == 2):
            self.problem(f"{what} must return (messages, info), got {type(result).__name__}")
            return None
        messages, info = result
        self.check_info(what, info)
        if not self.check_messages(what, messages, from_env=True):
            return None
        if not messages:
            self.problem(f"{what} returned no messages: the model needs a prompt")
        return list(messages)

    def check_step_result(self, what: str, result: Any) -> StepResult | None:
        if not isinstance(result, StepResult):
            self.problem(f"{what} must return a StepResult, got {type(result).__name__}")
            return None
        self.check_messages(what, result.messages, from_env=True)
        reward = result.reward
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            self.problem(f"{what} reward must be a float, got {type(reward).__name__} {reward!r}")
        elif not math.isfinite(reward):
            self.problem(f"{what} reward must be finite, got {reward!r}")
        for flag in ("terminated", "truncated"):
            value = getattr(result, flag)
            if type(value) is not bool:
                self.problem(f"{what} {flag} must be a bool, got {type(value).__name__} {value!r}")
        self.check_info(what, result.info)
        self.check_signals(what, result)
        return result

    def check_signals(self, what: str, result: StepResult) -> None:
        """The typed signals the rollout records; the same names in `info` are not read any more."""
        breakdown = result.reward_breakdown
        if not isinstance(breakdown, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in breakdown.items()
        ):
            self.problem(f"{what} reward_breakdown must map names to floats, got {breakdown!r}")
        if result.truncation_reason is not None and not isinstance(result.truncation_reason, str):
            self.problem(f"{what} truncation_reason must be a str or None, got {result.truncation_reason!r}")
        for key in ("tool_errors", "tool_timeouts"):
            value = getattr(result, key)
            if value is not None and (type(value) is not int or value < 0):
                self.problem(f"{what} {key} must be a count (int >= 0) or None, got {value!r}")
        moved = sorted(k for k in ("reward_breakdown", "truncation_reason", "tool_errors", "tool_timeouts", "state_key")
                       if isinstance(result.info, dict) and k in result.info)
        if moved:
            self.warn(f"{what} info holds {moved}: the rollout reads these from StepResult fields "
                      "(and the state key from Env.state_key()), not from info")

    async def episode(self, index: int, task: Task, seed: int, policy: Policy, max_steps: int) -> None:
        first = await self.reset(task, seed)
        if first is None:
            return
        second = await self.reset(task, seed)
        if second is not None and _plain(first) != _plain(second):
            self.problem(
                f"reset(task {task.get('id')!r}, seed={seed}) is not deterministic: "
                "two resets with the same seed gave different messages"
            )
        history = list(second or first)
        for turn in range(max_steps):
            what = f"episode {index} step {turn}"
            action = self.env.parse_action(policy(history))
            ok, raw = await self.call(what, self.env.step(action))
            if not ok:
                return
            result = self.check_step_result(what, raw)
            if result is None:
                return
            self.report.steps += 1
            history.append(action)
            if isinstance(result.messages, list):
                history.extend(m for m in result.messages if isinstance(m, Message))
            if result.terminated or result.truncated:
                self.report.episodes += 1
                return
        self.report.episodes += 1
        self.warn(f"episode {index} did not end within {max_steps} steps of a trivial policy")

    async def close_twice(self) -> None:
        await self.call("close()", self.env.close())
        await self.call("a second close()", self.env.close())


def _plain(messages: Sequence[Message]) -> list[tuple[str, str, str | None]]:
    return [(m.role, m.content, m.name) for m in messages]


async def acheck_env(
    env: Env,
    *,
    tasks: Iterable[Task] | None = None,
    n_episodes: int = 2,
    split: str = "train",
    policy: Policy | None = None,
    max_steps: int = 16,
    seed: int = 0,
    timeout_s: float = 30.0,
) -> EnvCheckReport:
    """Check `env` (async); raise `EnvCheckError` listing every problem found.

    `tasks` overrides `env.tasks(split)`; episode i runs task i (cycling) with
    seed `seed + i`, replying with `policy(messages)` (default: "I don't know.").
    """
    if not isinstance(env, Env):
        raise EnvCheckError(type(env).__name__, [f"{env!r} is not an agentrl Env instance"])
    checker = _Checker(env, timeout_s)
    checker.check_class()
    checker.check_tools()
    checker.check_parse_action()
    task_list = checker.check_tasks(tasks, split, n_episodes)
    async_api = all(inspect.iscoroutinefunction(getattr(type(env), m, None)) for m in ("reset", "step", "close"))
    if task_list and async_api:
        for i in range(n_episodes):
            await checker.episode(i, task_list[i % len(task_list)], seed + i, policy or default_policy, max_steps)
    if async_api:
        await checker.close_twice()
    if checker.problems:
        raise EnvCheckError(checker.name, checker.problems)
    return checker.report


def check_env(
    env: Env,
    *,
    tasks: Iterable[Task] | None = None,
    n_episodes: int = 2,
    split: str = "train",
    policy: Policy | None = None,
    max_steps: int = 16,
    seed: int = 0,
    timeout_s: float = 30.0,
) -> EnvCheckReport:
    """Synchronous `acheck_env` (for scripts and the CLI; inside a loop, await acheck_env)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("check_env() was called inside a running event loop; use `await acheck_env(...)`")
    return asyncio.run(
        acheck_env(
            env,
            tasks=tasks,
            n_episodes=n_episodes,
            split=split,
            policy=policy,
            max_steps=max_steps,
            seed=seed,
            timeout_s=timeout_s,
        )
    )
