"""`skyrl_gym`: SkyRL-Gym environments, with their datasets, trained by agentrl as they are.

SkyRL-Gym (`pip install skyrl-gym`) envs are text-in/text-out: built per
sample from a dataset row (`skyrl_gym.make(env_class, env_config=...,
extras=row)`), `init(prompt)` returns the opening messages, and
`step(reply_text)` returns `{observations, reward, done, metadata}`. This
adapter reads SkyRL-format rows (`prompt` as chat messages, `env_class`,
`reward_spec`, `extra_info`; parquet, jsonl, json or a hub dataset) and runs
each episode in the row's env:

- the opening is `init(row["prompt"])`; each model reply goes to `step` as
  text (a SkyRL env parses its own actions and tool calls), in a worker thread
  since SkyRL envs are synchronous (SQL, search and code envs block);
- each step's reward is that turn's reward; `done` terminates the episode;
  observations (OpenAI-style message dicts) become the env's messages;
- `env_config` reaches the env as an OmegaConf config (attribute access, as
  SkyRL passes it); `modules` are imported first, so envs registered with
  `skyrl_gym.register` in your own code resolve by id.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message

from .dataset_env import Source, _jsonable, read_rows

_SPLITS = ("train", "test")


class SkyRLGymConfig(EnvConfig):
    """Config of the `skyrl_gym` env."""

    train: Source = Field(description="SkyRL-format rows of the train split (prompt, env_class, reward_spec, ...)")
    test: Source | None = Field(None, description="rows of the test split; none: the run has no eval tasks")
    env_class: str | None = Field(
        None, description="skyrl_gym env id for rows without an env_class (e.g. gsm8k, gsm8k_multi_turn, text2sql)"
    )
    env_config: dict[str, JSON] = Field(default_factory=dict, description="the envs' env_config (SkyRL's per-env settings)")
    modules: list[str] = Field(
        default_factory=list, description="modules to import first: envs they register with skyrl_gym.register"
    )
    max_tasks: int | None = Field(None, ge=1, description="use only the first N rows of each split")


class SkyRLGymEnv(Env[SkyRLGymConfig]):
    """One SkyRL-Gym env per episode, made from the episode's dataset row."""

    name: ClassVar[str] = "skyrl_gym"
    description: ClassVar[str] = "SkyRL-Gym envs and SkyRL-format datasets (needs skyrl-gym)"

    def __init__(self, config: SkyRLGymConfig | None = None) -> None:
        super().__init__(config)
        self._env: Any = None
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in _SPLITS:
            raise ValueError(f"split={split!r} is not a split of skyrl_gym (allowed: train, test)")
        if split not in self._tasks:
            source = self.config.train if split == "train" else self.config.test
            self._tasks[split] = self._to_tasks(read_rows(source), split) if source is not None else []
        return iter(self._tasks[split])

    def _to_tasks(self, rows: Iterable[dict[str, Any]], split: str) -> list[Task]:
        out: list[Task] = []
        for n, row in enumerate(rows):
            if self.config.max_tasks is not None and n >= self.config.max_tasks:
                break
            task: Task = {str(k): _jsonable(v) for k, v in row.items()}
            if not task.get("env_class"):
                if self.config.env_class is None:
                    raise ValueError(f"{split} row {n} has no env_class and env.env_class is not set")
                task["env_class"] = self.config.env_class
            if not isinstance(task.get("prompt"), list):
                raise ValueError(f"{split} row {n}: prompt must be a list of chat messages, got {type(task.get('prompt')).__name__}")
            extra_info = task.get("extra_info")
            extra: dict[str, Any] = extra_info if isinstance(extra_info, dict) else {}
            task["id"] = f"{split}/{task.get('id', extra.get('index', n))}"
            out.append(task)
        return out

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        await self.close()
        skyrl_gym = _import_skyrl_gym()
        for module in self.config.modules:
            importlib.import_module(module)
        from omegaconf import OmegaConf

        extras = {k: v for k, v in task.items() if not k.startswith("_")}
        self._env = skyrl_gym.make(str(task["env_class"]), env_config=OmegaConf.create(self.config.env_config), extras=extras)
        opening, info = await asyncio.to_thread(self._env.init, task["prompt"])
        return _messages(opening), dict(info or {})

    async def step(self, action: Message) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() called before reset()")
        out = await asyncio.to_thread(self._env.step, action.content)
        done = bool(out["done"])
        metadata = out.get("metadata") or {}
        return StepResult(
            messages=[] if done else _messages(out.get("observations") or []),
            reward=float(out["reward"]),
            terminated=done,
            info={str(k): _jsonable(v) for k, v in metadata.items()},
        )

    async def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            await asyncio.to_thread(env.close)


def _messages(observations: Iterable[dict[str, Any]]) -> list[Message]:
    """SkyRL's OpenAI-style message dicts as agentrl messages."""
    return [Message(role=m["role"], content=str(m.get("content", ""))) for m in observations]


def _import_skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError as e:
        raise ImportError("the skyrl_gym env needs SkyRL-Gym: pip install 'agentrl[skyrl]' (or skyrl-gym)") from e
    return skyrl_gym
