"""The environment contract: Gymnasium semantics, async, text/chat observations.

An episode is `reset(task)` -> initial messages, then `step(assistant message)`
-> new messages plus reward, `terminated` (the task reached an end state) and
`truncated` (stopped by a limit, not by the task) exactly as in Gymnasium.
Each env owns a pydantic config (an `EnvConfig` subclass); the registry
validates user params into it. `Env` is generic over that config:
`class MyEnv(Env[MyConfig])` makes `MyConfig` its `Config` and types
`self.config` as `MyConfig`; a plain `Env` subclass means `Env[EnvConfig]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Generic,
    Protocol,
    cast,
    get_args,
    get_origin,
    runtime_checkable,
)

from pydantic import BaseModel, ConfigDict
from typing_extensions import TypeVar

from agentrl.types import JSON, Message, Trajectory

if TYPE_CHECKING:
    from agentrl.tools import Tool

Task = dict[str, JSON]
"""A task is a JSON-able dict; `task["id"]` identifies it (stable across runs)."""


class EnvConfig(BaseModel):
    """Base of every env's own config: unknown keys are errors, never ignored."""

    model_config = ConfigDict(extra="forbid")


ConfigT = TypeVar("ConfigT", bound=EnvConfig, default=EnvConfig)
"""An env's config type: `Env[ConfigT]`; unparameterised `Env` means `Env[EnvConfig]`."""


MIX_MEMBER_KEY = "_env"
"""Task key naming the member env of a mixture (`mix`): metrics break rewards down by it."""


@dataclass(slots=True)
class StepResult:
    """What one `Env.step` returns: Gymnasium's 5-tuple with messages as the observation,
    plus the typed signals the rollout records on the trajectory.

    - `reward_breakdown`: named parts of `reward` (merged into `Trajectory.reward_breakdown`);
    - `truncation_reason`: why a `truncated` step stopped the episode
      (`Trajectory.truncation_reason`; "env" when not given);
    - `tool_errors` / `tool_timeouts`: how many of this step's tool calls failed / timed
      out (None: the step ran no tools); stored on the turn (`Turn.info`).

    `info` is the env's own data: the rollout never reads it (the replay UI shows it).
    """

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, JSON] = field(default_factory=dict)
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    truncation_reason: str | None = None
    tool_errors: int | None = None
    tool_timeouts: int | None = None
    agent_rewards: dict[str, float] | None = None  # multi-agent envs (`TurnTaking`): this step's reward of
    # every agent it rewards, by agent id; None: `reward` is the acting agent's alone


@runtime_checkable
class EpisodeDriver(Protocol):
    """An env that runs its own episodes instead of being stepped by `run_episode`.

    The `agent` env is one: the user's agent code drives the conversation
    through the OpenAI-compatible gateway. The rollout manager calls
    `drive_episode` in place of `run_episode`, under the same groups, slots,
    failure policy and cancellation. It returns the episode's trajectories:
    the main one first (its `error` decides the failure policy), then any
    branches, which join the same group.
    """

    async def drive_episode(
        self,
        task: Task,
        engine: Any,
        tokenizer: Any,
        config: Any,
        *,
        seed: int | None,
        group_id: str,
        sample_index: int,
    ) -> list[Trajectory]: ...


@runtime_checkable
class TurnTaking(Protocol):
    """A multi-agent env: agents act in turn, each with its own view (PettingZoo's AEC cycle, in messages).

    After `reset`, `agents()` names every agent of the episode and
    `current_agent()` the one whose action the next `step` applies (None: the
    episode is over). `observe(agent)` returns the messages `agent` has not yet
    seen: the env's reports of the other agents' moves and of the game, each
    message once (a second call returns only what came since). `reset`'s opening
    messages are every agent's first messages. A step's `StepResult.messages`
    go to the agent that acted; `StepResult.agent_rewards` rewards any agent
    (a game's win and loss at its end), else `reward` is the acting agent's.

    The run maps each agent id to a policy (`agents:` in the run config). An
    env that can play an agent itself (a random or scripted opponent, a policy
    that does not train) also offers `OpponentMoves`.
    """

    def agents(self) -> list[str]: ...

    def current_agent(self) -> str | None: ...

    def observe(self, agent: str) -> list[Message]: ...


@runtime_checkable
class OpponentMoves(Protocol):
    """A multi-agent env that can move for an agent itself: `kind` "random" (a uniformly random legal move)
    or "scripted" (the env's own fixed strategy); `seed` makes it reproducible per move."""

    def opponent_move(self, agent: str, kind: str, seed: int) -> Message: ...


class Env(ABC, Generic[ConfigT]):
    """A multi-turn environment the policy talks to.

    Subclasses name their own `EnvConfig` subclass as the type argument
    (`class MyEnv(Env[MyConfig])`): it becomes the class's `Config` (the model
    the registry validates user params with) and the type of `self.config`.
    They implement `tasks`, `reset` and `step`, and may override `parse_action`
    (how model text becomes a message) and `close`. A subclass of plain `Env`
    that sets `Config = MyConfig` itself (the older plugin style) works too.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Config: ClassVar[type[EnvConfig]] = EnvConfig
    tools: Sequence[Tool] = ()
    config: ConfigT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        named = _config_argument(cls)
        if named is None:
            return
        if "Config" not in cls.__dict__:
            cls.Config = named
        elif not issubclass(cls.Config, named):
            raise TypeError(
                f"{cls.__name__}.Config is {cls.Config.__name__}, which is not a subclass of its type argument "
                f"{named.__name__}: drop the Config line (the argument sets it) or make the two agree"
            )

    def __init__(self, config: ConfigT | None = None) -> None:
        self.config = config if config is not None else self._default_config()

    def _default_config(self) -> ConfigT:
        """This env's config with every default (`Config()`); subclasses that need it before `__init__` call it."""
        # `Config` is the model named by the type argument (`__init_subclass__`), so its instance is a ConfigT
        return cast(ConfigT, self.Config())

    @abstractmethod
    def tasks(self, split: str = "train") -> Iterable[Task]:
        """The tasks of a split ("train", "test", ...), in a deterministic order."""

    @abstractmethod
    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode on `task`; return the opening messages and info."""

    @abstractmethod
    async def step(self, action: Message) -> StepResult:
        """Apply the model's message; return what the env says back."""

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tool schemas the chat template renders into the prompt (None: no tools)."""
        return [tool.schema() for tool in self.tools] or None

    def state_key(self) -> str | None:
        """A key for the state the next model turn acts on; None when the env has none.

        The rollout asks after `reset` and after every `step` and stores the
        answer on the next turn (`Turn.info["state_key"]`). Turns of one group
        with equal keys faced the same state: turn-level credit (GiGPO) compares
        them. Without a key the rendered observation stands in
        (`Trajectory.turn_states`).
        """
        return None

    def parse_action(self, text: str) -> Message:
        """Turn the model's decoded reply into an assistant message."""
        return Message(role="assistant", content=text)

    def demonstrations(self) -> list[list[Message]]:
        """Optional worked conversations (few-shot prompts, SFT warm start)."""
        return []

    def oracle(self, task: Task) -> list[Message] | None:
        """A known-good solution of `task`: the assistant messages to send, in order, whatever the
        observations; None where the env has none. `agentrl eval --oracle` plays it through the env
        (a task that the oracle does not solve is a broken task or a broken reward)."""
        return None

    def demonstration_sets(self) -> list[tuple[list[dict[str, Any]] | None, list[list[Message]]]]:
        """The demonstrations grouped by the tool schemas their prompts render with.

        One set by default: this env's `prompt_tools()` and `demonstrations()`.
        An env whose episodes use different tools (a mixture) returns a set per tool list.
        """
        return [(self.prompt_tools(), self.demonstrations())]

    def episode_name(self) -> str:
        """The env name recorded on the trajectory of the current episode (`Trajectory.env`)."""
        return self.name or type(self).__name__

    async def close(self) -> None:
        """Release resources (sandboxes, files). Safe to call twice."""
        return None


def _config_argument(cls: type) -> type[EnvConfig] | None:
    """The config class `cls` names as its `Env[...]` type argument, if it names a concrete one."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Env):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, EnvConfig):
                    return arg
    return None
