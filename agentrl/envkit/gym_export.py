"""agentrl env -> gymnasium: every env of a `Plugins` object as a gymnasium env.

`register_gymnasium(plugins)` registers every env of a `Plugins` object as
`agentrl/<name>-v0`, so `gymnasium.make("agentrl/<name>-v0", **params)` gives a
synchronous `gymnasium.Env` whose observations are the rendered new messages
(text) and whose actions are the assistant's reply text. The async env runs on
a private event loop thread. The opposite adapter (a gymnasium env played in
chat) is `agentrl.envkit.gym_bridge.GymnasiumEnv`.

Gymnasium is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import re
import threading
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.env import Env, StepResult, Task
from agentrl.types import Message

if TYPE_CHECKING:
    from agentrl.registry import Plugins

T = TypeVar("T")
_GYM_ID_NAME = re.compile(r"^[\w.-]+$")
RESERVED_MAKE_KWARGS = ("render_mode", "split")


def render_messages(messages: Sequence[Message]) -> str:
    """Messages as plain text, one block per message (`role: content`)."""
    blocks = []
    for m in messages:
        head = f"{m.role}" + (f" ({m.name})" if m.name else "")
        text = f"{head}: {m.content}"
        for call in m.tool_calls:
            text += f"\n[tool call {call.name}({call.arguments})]"
        blocks.append(text)
    return "\n\n".join(blocks)


def _text_space(max_length: int) -> Any:
    """A gymnasium Text space holding any string (Text alone allows a fixed charset)."""
    import string

    from gymnasium.spaces import Text

    class AnyText(Text):
        def contains(self, x: Any) -> bool:
            return isinstance(x, str) and len(x) <= self.max_length

    return AnyText(max_length, min_length=0, charset=string.printable)


class _LoopThread:
    """An event loop on a daemon thread, so sync callers work even inside a running loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agentrl-gym-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@functools.cache
def gym_env_class() -> Any:
    """The `AgentrlGymEnv` class (defined on first use so gymnasium is imported lazily)."""
    import gymnasium

    class AgentrlGymEnv(gymnasium.Env[str, str]):
        """A synchronous gymnasium view of an agentrl env (text in, text out).

        `reset(seed=, options={"task": {...}} | {"task_id": ...})` picks a task
        (by default one from `env.tasks(split)` drawn with the seeded RNG);
        `info["messages"]` carries the new messages as dicts.
        """

        metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (gymnasium style)

        def __init__(
            self,
            env: Env,
            *,
            split: str = "train",
            render_mode: str | None = None,
            timeout_s: float = 300.0,
            max_length: int = 1_000_000,
        ) -> None:
            if render_mode not in (None, "ansi"):
                raise ValueError(f"render_mode {render_mode!r} is not supported; allowed: 'ansi' or None")
            self.env = env
            self.split = split
            self.render_mode = render_mode
            self.timeout_s = timeout_s
            self.observation_space = _text_space(max_length)
            self.action_space = _text_space(max_length)
            self._tasks: list[Task] | None = None
            self._transcript: list[Message] = []
            self._runner: _LoopThread | None = _LoopThread()

        def _run(self, coro: Coroutine[Any, Any, T]) -> T:
            if self._runner is None:
                coro.close()
                raise RuntimeError("this env is closed")
            return self._runner.run(coro, self.timeout_s)

        def _pick_task(self, options: dict[str, Any] | None) -> Task:
            options = options or {}
            if "task" in options:
                task: Task = dict(options["task"])
                return task
            if self._tasks is None:
                self._tasks = list(self.env.tasks(self.split))
                if not self._tasks:
                    raise ValueError(f"env {self.env.name!r} has no tasks in split {self.split!r}")
            if "task_id" in options:
                for task in self._tasks:
                    if task.get("id") == options["task_id"]:
                        return task
                raise KeyError(f"no task with id {options['task_id']!r} in split {self.split!r}")
            return self._tasks[int(self.np_random.integers(len(self._tasks)))]

        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
            super().reset(seed=seed)
            task = self._pick_task(options)
            messages, info = self._run(self.env.reset(task, seed=seed))
            self._transcript = list(messages)
            # Fresh objects every call: callers may keep and mutate what they get.
            info = copy.deepcopy(
                {**info, **_state_key_info(self.env), "task": task, "messages": [m.to_dict() for m in messages]}
            )
            return render_messages(messages), info

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            message = self.env.parse_action(action)
            result = self._run(self.env.step(message))
            self._transcript.append(message)
            self._transcript.extend(result.messages)
            info = copy.deepcopy(
                {**result.info, **_signal_info(result), **_state_key_info(self.env),
                 "messages": [m.to_dict() for m in result.messages]}
            )
            return (
                render_messages(result.messages),
                float(result.reward),
                bool(result.terminated),
                bool(result.truncated),
                info,
            )

        def render(self) -> str | None:
            return render_messages(self._transcript) if self.render_mode == "ansi" else None

        def close(self) -> None:
            if self._runner is None:
                return
            try:
                self._run(self.env.close())
            finally:
                self._runner.stop()
                self._runner = None

    return AgentrlGymEnv


def _signal_info(result: StepResult) -> dict[str, Any]:
    """A step's typed signals as gymnasium info keys (those it set)."""
    out: dict[str, Any] = {}
    if result.reward_breakdown:
        out["reward_breakdown"] = dict(result.reward_breakdown)
    for key in ("truncation_reason", "tool_errors", "tool_timeouts"):
        value = getattr(result, key)
        if value is not None:
            out[key] = value
    return out


def _state_key_info(env: Env) -> dict[str, Any]:
    key = env.state_key()
    return {} if key is None else {"state_key": key}


def make_gym_env(plugins: Plugins, name: str, **kwargs: Any) -> Any:
    """The gymnasium view of agentrl env `name`; kwargs are its params (plus render_mode, split)."""
    options = {k: kwargs.pop(k) for k in RESERVED_MAKE_KWARGS if k in kwargs}
    env = plugins.create_env(name, kwargs)
    return gym_env_class()(env, **options)


def register_gymnasium(plugins: Plugins | None = None, *, namespace: str = "agentrl") -> list[str]:
    """Register every env of `plugins` (default: the installed ones) in gymnasium's registry.

    Returns the ids. Gymnasium's registry is gymnasium's own global;
    re-registering replaces the previous entry for the same id.
    """
    import gymnasium

    if plugins is None:
        from agentrl.registry import Plugins

        plugins = Plugins.discover()

    ids = []
    for name in plugins.envs.names():
        if not _GYM_ID_NAME.match(name):
            continue
        env_id = f"{namespace}/{name}-v0"
        gymnasium.registry.pop(env_id, None)
        gymnasium.register(id=env_id, entry_point=functools.partial(make_gym_env, plugins, name))
        ids.append(env_id)
    return ids
