"""The trainer contract: what a run asks of a trainer backend (torch-free).

`agentrl train` drives a trainer through these calls, whatever runs behind
them (the `torch` trainer in this process, the `ray` group of ranks):

- `train_step(groups)`: one RL update on a batch of finished groups. It returns
  the step's metrics and, per trajectory, the per-token trainer values the
  replay token view shows (`TokenStats`); the caller stores them, the trainer
  never writes into the trajectories it was given.
- `sft_step(samples)`: one supervised update (warm start).
- `state_for_engines()`: the current weights for `InferenceEngine.update_weights`.
- `save(path, extra_state)` / `load(path)`: a checkpoint; `load` returns the
  `extra_state` it was saved with (the loop keeps its step there).
- `policy_version`: how many updates the weights have had; every update
  (RL or SFT) adds one, and engines serve weights under this number.

A trainer that runs processes of its own (the `ray` group's ranks) may also
have a `close()` (`ClosableTrainer`); the run calls it when it ends.

The implementations live in `agentrl.trainers` (torch); this module only names
the shape, so the core can type `Parts.trainer` without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentrl.engines.base import AdapterSpec, WeightSource
from agentrl.types import JSON, Group, TrainSample

TokenStats = dict[str, list[JSON]]
"""Per-token trainer values of one trajectory, each list aligned with its `token_ids`.

Keys: `trainer_logprobs`, `advantages`, `is_weights`, `is_mask` (None off the
loss mask). Stored as `Trajectory.info["token_stats"]` (docs/replay.md).
"""


@dataclass(slots=True)
class TrainStepResult:
    """What one `train_step` hands back: metrics, and token stats by trajectory id.

    `token_stats` holds the trajectories the step recorded (all of them with
    `trainer.record_token_stats`, none without).
    """

    metrics: dict[str, float]
    token_stats: dict[str, TokenStats] = field(default_factory=dict)


@runtime_checkable
class Trainer(Protocol):
    """A trainer backend (see the module docstring for what each call does)."""

    @property
    def policy_version(self) -> int: ...

    def train_step(self, groups: Sequence[Group]) -> TrainStepResult: ...

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]: ...

    def state_for_engines(self) -> WeightSource: ...

    def save(self, path: str | Path, extra_state: Mapping[str, JSON] | None = None) -> None: ...

    def load(self, path: str | Path) -> dict[str, Any]: ...


@runtime_checkable
class ClosableTrainer(Protocol):
    """A trainer with processes or resources of its own to end (`close()`); the run calls it when it ends."""

    def close(self) -> None: ...


@runtime_checkable
class AdapterTrainer(Protocol):
    """A LoRA trainer whose policy an engine in its process can sample with (`BaseSharingEngine`).

    `lora_policy_for_engine()` is the policy module to share (None when it cannot
    be shared: several processes, no LoRA); `adapter_for_engines()` the adapter's
    tensors alone, what a sync hands such an engine.
    """

    def lora_policy_for_engine(self) -> Any: ...

    def adapter_for_engines(self) -> WeightSource: ...


@runtime_checkable
class DeltaTrainer(Protocol):
    """A trainer that can sync only what changed (`agentrl.weights.delta`).

    `delta_for_engines(engine_version, dtype)` is the sync from the version the engine serves to
    the trainer's (the whole model when the trainer holds no base for that version), or None when
    delta sync is off.
    """

    def delta_for_engines(self, engine_version: int, dtype: str) -> WeightSource | None: ...


@runtime_checkable
class PolicyTrainer(Protocol):
    """A LoRA trainer that can be one of several policies over one base (a multi-policy run).

    `adapter_spec()` is the shape of its adapter (None without LoRA), what an
    `AdapterEngine` needs to hold it; `share_base_from(other)` makes this trainer's
    frozen base tensors *be* `other`'s (one copy of the base for N policies) and
    says whether it did (both LoRA, same base, one process each).
    """

    def adapter_spec(self) -> AdapterSpec | None: ...

    def share_base_from(self, other: object) -> bool: ...

    def adapter_for_engines(self) -> WeightSource: ...


def group_samples(groups: Sequence[Group]) -> list[list[TrainSample]]:
    """The trainer's view (`Trajectory.tokens()`) of each group's trajectories, group by group; empty groups dropped."""
    return [[t.tokens() for t in g.trajectories] for g in groups if g.trajectories]
