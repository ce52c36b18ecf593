"""gymnasium env -> agentrl: `GymnasiumEnv` plays a gymnasium env in chat (the `gymnasium` env plugin).

`GymnasiumEnv` plays any gymnasium env whose action space is `Text` or
`Discrete` (observations: `Text`, `Discrete` rendered through the env's "ansi"
render mode, or anything through `format_observation`) in chat. Discrete
actions are parsed from the reply: `<action>NAME</action>`, an action index, or
an action name from `action_names`. `terminated` and `truncated` are passed
through unchanged. The opposite adapter (agentrl envs as gymnasium envs) is
`agentrl.envkit.gym_export`.

Gymnasium is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message

_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m(.+?)\x1b\[0m", re.DOTALL)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)


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


class GymnasiumEnv(Env[GymnasiumEnvConfig]):
    """Plays a Gymnasium env with text or discrete spaces in chat."""

    name: ClassVar[str] = "gymnasium"
    description: ClassVar[str] = "Any Gymnasium env with Text/Discrete spaces, played as text."

    def __init__(self, config: GymnasiumEnvConfig | None = None) -> None:
        super().__init__(config)
        self._gym: Any = None
        self._ansi = False
        self._invalid = 0

    # ---------------------------------------------------------------- overridable hooks

    def make_gym(self) -> Any:
        """Build the gymnasium env (with the "ansi" render mode when observations need it)."""
        import gymnasium
        from gymnasium.envs.registration import load_env_creator

        spec = gymnasium.spec(self.config.gym_id)
        creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
        render_modes = getattr(creator, "metadata", {}).get("render_modes", [])
        self._ansi = self.config.observation != "value" and "ansi" in render_modes
        if self.config.observation == "ansi" and not self._ansi:
            raise ValueError(f"env.observation='ansi' but {self.config.gym_id!r} renders only {render_modes}")
        kwargs: dict[str, Any] = dict(self.config.make_kwargs)
        if self._ansi:
            kwargs["render_mode"] = "ansi"
        return gymnasium.make(self.config.gym_id, **kwargs)

    def format_observation(self, observation: Any, info: dict[str, Any]) -> str:
        """Observation -> text: Text as is, the ansi rendering, else `str(observation)`."""
        from gymnasium.spaces import Text

        if isinstance(self.gym.observation_space, Text) and isinstance(observation, str):
            return observation
        if self._ansi and self.config.observation != "value":
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
            if self.config.action_names:
                choices = ", ".join(f"{name} ({start + i})" for i, name in enumerate(self.config.action_names))
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
        names = [n.lower() for n in self.config.action_names or []]
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
                    f"gymnasium env {self.config.gym_id!r} has action space {space}; "
                    "GymnasiumEnv supports Text or Discrete action spaces"
                )
            names = self.config.action_names
            if isinstance(space, Discrete) and names is not None and len(names) != int(space.n):
                raise ValueError(f"env.action_names has {len(names)} names but {self.config.gym_id!r} has {space.n} actions")
        return self._gym

    def tasks(self, split: str = "train") -> Iterable[Task]:
        offsets = {"train": 0, "test": self.config.test_offset}
        if split not in offsets:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(offsets)}")
        first = offsets[split]
        return ({"id": f"{self.config.gym_id}/seed-{s}", "seed": s} for s in range(first, first + self.config.num_tasks))

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        import numpy as np

        task_seed = int(task["seed"])
        observation, info = self.gym.reset(seed=task_seed)  # the task fixes the start state
        if seed is not None:  # the sample seed varies the dynamics, reproducibly
            self.gym.unwrapped.np_random = np.random.default_rng([task_seed, seed])
        self._invalid = 0
        messages = [Message(role="system", content=self.config.instructions)] if self.config.instructions else []
        messages.append(Message(role="user", content=self._observation_text(observation, info)))
        return messages, {"gym_info": _jsonable(info)}

    async def step(self, action: Message) -> StepResult:
        gym_action = self.parse_gym_action(action.content)
        if gym_action is None:
            self._invalid += 1
            return StepResult(
                messages=[Message(role="user", content=f"Invalid action. {self.action_help()}")],
                reward=self.config.invalid_action_reward,
                truncated=self._invalid > self.config.max_invalid_actions,
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
