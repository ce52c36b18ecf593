"""`mix`: several envs trained in one run, each task drawn by weight.

```yaml
env:
  name: mix
  envs:
    - {name: math, weight: 2, params: {dataset: basic_arithmetic}}
    - {name: gym_text, params: {game: frozenlake}, label: lake}
```

Each member is any env plugin with its own params (checked when the config
loads, errors under `env.envs.<i>.params`). Tasks carry their member's label
under `_env`; an episode builds that member and hands every call to it:
reset, step, `parse_action`, `prompt_tools` (so each member's tools render in
its own prompts) and close. The trajectory's `env` is the label, which is what
per-env metrics (`reward/mean/<env>`, `eval/<env>/reward_mean`) and the replay
filter by.

Proportions. The train split holds every member's tasks in proportion to its
weight: a member with fewer tasks than its share repeats them (in order), so
that each member's list is used at least once per epoch of the mixture. Other
splits (eval) list each member's tasks once, interleaved by weight, so the
first N cover every member in proportion until one runs out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from pydantic import Field, model_validator

from agentrl.env import MIX_MEMBER_KEY as MEMBER_KEY
from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.registry import PluginRef
from agentrl.run.resources import RunResources
from agentrl.types import JSON, Message

from .tool_support import resolve_plugins, run_resources


class MemberSpec(PluginRef):
    """One env of the mixture: a plugin name, its params, a weight and a label."""

    kind: ClassVar[str] = "envs"
    name: str = Field(description="env plugin name")
    params: dict[str, JSON] = Field(default_factory=dict, description="options of that env (its Config)")
    weight: float = Field(1.0, gt=0, description="share of the training tasks, relative to the other members")
    label: str | None = Field(
        None, description="name in metrics and trajectories (default: the plugin name; needed when one repeats)"
    )

    @property
    def key(self) -> str:
        return self.label or self.name


class MixConfig(EnvConfig):
    """Config of the `mix` env."""

    envs: list[MemberSpec] = Field(min_length=1, description="the member envs")

    @model_validator(mode="after")
    def _unique_labels(self) -> MixConfig:
        seen: set[str] = set()
        for i, member in enumerate(self.envs):
            if member.key in seen:
                raise ValueError(
                    f"envs.{i}: label {member.key!r} is used twice; give each member a distinct `label`"
                )
            if member.name == "mix":
                raise ValueError(f"envs.{i}.name: a mix cannot contain a mix")
            seen.add(member.key)
        return self


class MixEnv(Env[MixConfig]):
    """Delegates each episode to the member env its task belongs to."""

    name: ClassVar[str] = "mix"
    description: ClassVar[str] = "several envs in one run, tasks drawn by weight; per-env metrics"

    def __init__(
        self, config: MixConfig | None = None, *, plugins: Any = None, resources: RunResources | None = None
    ) -> None:
        super().__init__(config)
        self.plugins = resolve_plugins(plugins)
        self.resources, self._owns_resources = run_resources(resources)  # handed to every member
        self._members = {m.key: m for m in self.config.envs}
        self._listing: dict[str, Env] = {}  # one env per member for tasks() and demonstrations
        self._current: Env | None = None
        self._label: str | None = None

    def _build(self, label: str) -> Env:
        member = self._members[label]
        env: Env = self.plugins.create_env(member.name, member.params, resources=self.resources)
        return env

    def _lister(self, label: str) -> Env:
        env = self._listing.get(label)
        if env is None:
            env = self._listing[label] = self._build(label)
        return env

    def tasks(self, split: str = "train") -> Iterable[Task]:
        lists = {}
        for label in self._members:
            lists[label] = [dict(task, **{MEMBER_KEY: label}) for task in self._lister(label).tasks(split)]
        weights = {label: m.weight for label, m in self._members.items() if lists[label]}
        if not weights:
            return []
        if split == "train":
            total = sum(weights.values())
            length = max(math.ceil(len(lists[k]) * total / w) for k, w in weights.items())
            counts = {k: max(len(lists[k]), round(length * w / total)) for k, w in weights.items()}
        else:
            counts = {k: len(lists[k]) for k in weights}
        return [lists[k][i % len(lists[k])] for k, i in interleave(weights, counts)]

    def demonstration_sets(self) -> list[tuple[list[dict[str, Any]] | None, list[list[Message]]]]:
        return [s for label in self._members for s in self._lister(label).demonstration_sets()]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        label = task.get(MEMBER_KEY)
        if label not in self._members:
            raise ValueError(
                f"task {task.get('id')!r} names member env {label!r} ({MEMBER_KEY}); "
                f"this mix has {sorted(self._members)}"
            )
        if label != self._label:
            await self._close_current()
            self._current, self._label = self._build(label), label
        assert self._current is not None
        inner = {k: v for k, v in task.items() if k != MEMBER_KEY}
        return await self._current.reset(inner, seed=seed)

    async def step(self, action: Message) -> StepResult:
        if self._current is None:
            raise RuntimeError("step() called before reset()")
        return await self._current.step(action)

    def state_key(self) -> str | None:
        return self._current.state_key() if self._current is not None else None

    def parse_action(self, text: str) -> Message:
        return self._current.parse_action(text) if self._current is not None else super().parse_action(text)

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return self._current.prompt_tools() if self._current is not None else None

    def episode_name(self) -> str:
        return self._label or self.name

    async def _close_current(self) -> None:
        if self._current is not None:
            current, self._current = self._current, None
            await current.close()

    async def close(self) -> None:
        listing, self._listing = list(self._listing.values()), {}
        try:
            await self._close_current()
        finally:
            for env in listing:
                await env.close()
            if self._owns_resources:
                await self.resources.aclose()


def interleave(weights: dict[str, float], counts: dict[str, int]) -> list[tuple[str, int]]:
    """(label, index) pairs: `counts[label]` of each, spread by smooth weighted round robin.

    At every slot each member still holding items gains its weight in credit;
    the richest one is emitted and pays the active members' total weight. Any
    prefix is then as close to the weights' proportions as whole counts allow.
    """
    credit = dict.fromkeys(counts, 0.0)
    taken = dict.fromkeys(counts, 0)
    out: list[tuple[str, int]] = []
    active: Sequence[str] = [k for k in counts if counts[k] > 0]
    while active:
        total = sum(weights[k] for k in active)
        for k in active:
            credit[k] += weights[k]
        pick = max(active, key=lambda k: credit[k])
        credit[pick] -= total
        out.append((pick, taken[pick]))
        taken[pick] += 1
        active = [k for k in active if taken[k] < counts[k]]
    return out
