"""Gymnasium bridge, both ways.

(a) agentrl env -> gymnasium: `register_gymnasium(plugins)` registers every env
of a `Plugins` object as `agentrl/<name>-v0`, so `gymnasium.make(
"agentrl/<name>-v0", **params)` gives a synchronous `gymnasium.Env` whose
observations are the rendered new messages (text) and whose actions are the
assistant's reply text. The async env runs on a private event loop thread.

(b) gymnasium env -> agentrl: `GymnasiumEnv` plays any gymnasium env whose
action space is `Text` or `Discrete` (observations: `Text`, `Discrete` rendered
through the env's "ansi" render mode, or anything through `format_observation`)
in chat. Discrete actions are parsed from the reply: `<action>NAME</action>`,
an action index, or an action name from `action_names`. `terminated` and
`truncated` are passed through unchanged.

Gymnasium is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import re
import threading
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message

if TYPE_CHECKING:
    from agentrl.registry import Plugins

T = TypeVar("T")
_GYM_ID_NAME = re.compile(r"^[\w.-]+$")
_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m(.+?)\x1b\[0m", re.DOTALL)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)
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


def strip_ansi(text: str) -> str:
    """Terminal colours -> plain text; a highlighted span (the agent, usually) becomes `[X]`."""
    return _ANSI.sub("", _HIGHLIGHT.sub(r"[\1]", text))


def _jsonable(value: Any) -> JSON:
    """Gymnasium infos often hold numpy scalars/arrays; make them JSON-able."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _jsonable(tolist())
    return repr(value)


# --------------------------------------------------------------------------- (a) agentrl -> gymnasium


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

        def render(self) -> str | None:  # type: ignore[override]
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


# --------------------------------------------------------------------------- (b) gymnasium -> agentrl


class GymnasiumEnvConfig(EnvConfig):
    """Config of `GymnasiumEnv` (plugin name `gymnasium`)."""

    gym_id: str = Field(description="gymnasium env id, e.g. 'FrozenLake-v1'")
    make_kwargs: dict[str, JSON] = Field(default_factory=dict, description="extra kwargs for gymnasium.make")
    action_names: list[str] | None = Field(
        None, description="names of Discrete actions in index order (e.g. [left, down, right, up])"
    )
    instructions: str = Field("", description="system prompt: the rules of the game")
    observation: Literal["auto", "ansi", "value"] = Field(
        "auto", description="how observations become text: auto (Text as is, else ansi render, else str)"
    )
    num_tasks: int = Field(1000, ge=1, description="tasks (= reset seeds) per split")
    test_offset: int = Field(1_000_000, ge=0, description="first seed of the test split")
    max_invalid_actions: int = Field(3, ge=0, description="unparseable replies allowed before truncation")
    invalid_action_reward: float = Field(0.0, description="reward of a reply that names no valid action (0 or a penalty)")


class GymnasiumEnv(Env):
    """Plays a Gymnasium env with text or discrete spaces in chat."""

    name: ClassVar[str] = "gymnasium"
    description: ClassVar[str] = "Any Gymnasium env with Text/Discrete spaces, played as text."
    Config: ClassVar[type[EnvConfig]] = GymnasiumEnvConfig

    def __init__(self, config: EnvConfig | None = None) -> None:
        super().__init__(config)
        assert isinstance(self.config, GymnasiumEnvConfig)
        self.cfg: GymnasiumEnvConfig = self.config
        self._gym: Any = None
        self._ansi = False
        self._invalid = 0

    # ---------------------------------------------------------------- overridable hooks

    def make_gym(self) -> Any:
        """Build the gymnasium env (with the "ansi" render mode when observations need it)."""
        import gymnasium
        from gymnasium.envs.registration import load_env_creator

        spec = gymnasium.spec(self.cfg.gym_id)
        creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
        render_modes = getattr(creator, "metadata", {}).get("render_modes", [])
        self._ansi = self.cfg.observation != "value" and "ansi" in render_modes
        if self.cfg.observation == "ansi" and not self._ansi:
            raise ValueError(f"env.observation='ansi' but {self.cfg.gym_id!r} renders only {render_modes}")
        kwargs: dict[str, Any] = dict(self.cfg.make_kwargs)
        if self._ansi:
            kwargs["render_mode"] = "ansi"
        return gymnasium.make(self.cfg.gym_id, **kwargs)

    def format_observation(self, observation: Any, info: dict[str, Any]) -> str:
        """Observation -> text: Text as is, the ansi rendering, else `str(observation)`."""
        from gymnasium.spaces import Text

        if isinstance(self.gym.observation_space, Text) and isinstance(observation, str):
            return observation
        if self._ansi and self.cfg.observation != "value":
            rendered = self.gym.render()
            if isinstance(rendered, str) and rendered.strip():
                return strip_ansi(rendered).strip("\n")
        return str(_jsonable(observation))

    def action_help(self) -> str:
        """How to answer, shown with every observation."""
        from gymnasium.spaces import Discrete

        space = self.gym.action_space
        if isinstance(space, Discrete):
            start, n = int(space.start), int(space.n)
            if self.cfg.action_names:
                choices = ", ".join(f"{name} ({start + i})" for i, name in enumerate(self.cfg.action_names))
            else:
                choices = ", ".join(str(start + i) for i in range(n))
            return f"Actions: {choices}. Reply with <action>ACTION</action>."
        return "Reply with <action>YOUR ACTION</action>."

    def parse_gym_action(self, text: str) -> Any | None:
        """The gymnasium action the reply asks for, or None when it names none."""
        from gymnasium.spaces import Discrete, Text

        space = self.gym.action_space
        tagged = _TAG.findall(text)
        candidate = tagged[-1] if tagged else text.strip()
        if isinstance(space, Text):
            return candidate if space.contains(candidate) else None
        assert isinstance(space, Discrete)
        found = self._discrete(candidate, space)
        if found is None and not tagged:
            for word in reversed(re.findall(r"[\w-]+", text)):
                found = self._discrete(word, space)
                if found is not None:
                    break
        return found

    def _discrete(self, word: str, space: Any) -> int | None:
        word = word.strip().strip(".!\"'`").lower()
        names = [n.lower() for n in self.cfg.action_names or []]
        start, n = int(space.start), int(space.n)
        if word in names:
            return start + names.index(word)
        if re.fullmatch(r"-?\d+", word) and start <= int(word) < start + n:
            return int(word)
        return None

    # ---------------------------------------------------------------- Env API

    @property
    def gym(self) -> Any:
        if self._gym is None:
            from gymnasium.spaces import Discrete, Text

            self._gym = self.make_gym()
            space = self._gym.action_space
            if not isinstance(space, Text | Discrete):
                raise ValueError(
                    f"gymnasium env {self.cfg.gym_id!r} has action space {space}; "
                    "GymnasiumEnv supports Text or Discrete action spaces"
                )
            names = self.cfg.action_names
            if isinstance(space, Discrete) and names is not None and len(names) != int(space.n):
                raise ValueError(f"env.action_names has {len(names)} names but {self.cfg.gym_id!r} has {space.n} actions")
        return self._gym

    def tasks(self, split: str = "train") -> Iterable[Task]:
        offsets = {"train": 0, "test": self.cfg.test_offset}
        if split not in offsets:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(offsets)}")
        first = offsets[split]
        return ({"id": f"{self.cfg.gym_id}/seed-{s}", "seed": s} for s in range(first, first + self.cfg.num_tasks))

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        import numpy as np

        task_seed = int(task["seed"])
        observation, info = self.gym.reset(seed=task_seed)  # the task fixes the start state
        if seed is not None:  # the sample seed varies the dynamics, reproducibly
            self.gym.unwrapped.np_random = np.random.default_rng([task_seed, seed])
        self._invalid = 0
        messages = [Message(role="system", content=self.cfg.instructions)] if self.cfg.instructions else []
        messages.append(Message(role="user", content=self._observation_text(observation, info)))
        return messages, {"gym_info": _jsonable(info)}

    async def step(self, action: Message) -> StepResult:
        gym_action = self.parse_gym_action(action.content)
        if gym_action is None:
            self._invalid += 1
            return StepResult(
                messages=[Message(role="user", content=f"Invalid action. {self.action_help()}")],
                reward=self.cfg.invalid_action_reward,
                truncated=self._invalid > self.cfg.max_invalid_actions,
                info={"invalid_action": True},
            )
        observation, reward, terminated, truncated, info = self.gym.step(gym_action)
        return StepResult(
            messages=[Message(role="user", content=self._observation_text(observation, info))],
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info={"gym_info": _jsonable(info), "action": _jsonable(gym_action)},
        )

    def _observation_text(self, observation: Any, info: dict[str, Any]) -> str:
        return f"{self.format_observation(observation, info)}\n\n{self.action_help()}"

    async def close(self) -> None:
        if self._gym is not None:
            gym, self._gym = self._gym, None
            gym.close()
