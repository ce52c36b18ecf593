"""Several policies in one run (`policies:` and `agents:` in the run config).

Each trained policy is a trainer of its own (a LoRA adapter over the run's one
base: the torch trainer ties their frozen base tensors, `PolicyTrainer`), with
its own optimizer, trainer settings and checkpoint folder. `PolicyTrainers`
puts them behind the one `Trainer` interface the loop drives:

- a batch's groups are split by role first (`split_roles`: the trajectories of
  one agent id of a multi-agent game form a group of their own), so advantages
  are normalised per role (role-conditioned advantages, as in SPIRAL);
- each policy then trains on its own turns only (`policy_view`: the other
  policies' turns stay in the tokens as context, with loss mask 0);
- metrics come back as `policy/<name>/<key>`, plus the mean over the policies
  that stepped under the plain key (what alerts and the progress line read).

The engine holds one adapter per policy (`AdapterEngine`); `sync_policies`
pushes each trained policy's adapter under that policy's own version, and
`policy_lag` is the staleness gate's measure: for each policy, its version now
minus the oldest version among its tokens in the group.

Torch-free: the trainers are whatever the trainer plugin builds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig
from agentrl.engines.base import (
    AdapterEngine,
    CountedWeightSource,
    InferenceEngine,
    WeightSource,
    canonical_adapter_name,
)
from agentrl.errors import AgentrlError, ConfigError
from agentrl.rollout.roster import Roster
from agentrl.trainer import ClosableTrainer, PolicyTrainer, Trainer, TrainStepResult
from agentrl.types import JSON, Group, TrainSample, Trajectory

POLICIES_DIR = "policies"
"""A multi-policy checkpoint holds one trainer checkpoint per policy under `policies/<name>/`."""


def roster(config: RunConfig, *, evaluation: bool = False) -> Roster:
    """The run's roster (`agents:`, or `eval_agents:` over it for an evaluation)."""
    agents = dict(config.agents)
    if evaluation:
        agents |= config.eval_agents
    adapters = {name: (name if p.adapter else None) for name, p in config.policies.items()}
    opponents = {name: p.opponent for name, p in config.policies.items() if p.opponent is not None}
    return Roster(agents=agents, adapters=adapters, opponents=opponents)


def split_roles(groups: Sequence[Group]) -> list[Group]:
    """Each group split into one group per agent role (`Trajectory.info["agent"]`), in order of first appearance.

    A group without roles (single-agent episodes) is kept as it is, so a
    single-policy, single-agent run trains exactly as before.
    """
    out: list[Group] = []
    for group in groups:
        roles: dict[str, list[Trajectory]] = {}
        for traj in group.trajectories:
            roles.setdefault(str(traj.info.get("agent", "")), []).append(traj)
        if len(roles) <= 1:
            out.append(group)
            continue
        out.extend(Group(task_id=group.task_id, trajectories=trajs, id=f"{group.id}/{role}", task=group.task)
                   for role, trajs in roles.items())  # fmt: skip
    return out


def policy_view(traj: Trajectory, policy: str) -> Trajectory | None:
    """`traj` as `policy`'s trainer sees it: only its turns are sampled tokens; None when it has none."""
    mine = [t for t in traj.turns if t.policy == policy]
    if not mine:
        return None
    if len(mine) == len(traj.turns):
        return traj
    sample = traj.tokens(policy)
    return dataclasses.replace(traj, loss_mask=sample.loss_mask, turns=mine, id=traj.id)


def policy_groups(groups: Sequence[Group], policy: str) -> list[Group]:
    """The groups `policy` trains on: each group's trajectories that it sampled turns of, in its view."""
    out = []
    for group in groups:
        views = [v for t in group.trajectories if (v := policy_view(t, policy)) is not None]
        if views:
            out.append(Group(task_id=group.task_id, trajectories=views, id=group.id, task=group.task))
    return out


def policy_lag(group: Group, versions: Mapping[str, int]) -> int:
    """The group's staleness: max over policies of (its version now - its oldest version in the group).

    Turns of policies that do not train (not in `versions`) never make a group stale.
    """
    lag = 0
    for traj in group.trajectories:
        for turn in traj.turns:
            now = versions.get(turn.policy) if turn.policy is not None else None
            if now is None:
                continue
            sampled = [v for v, m in zip(traj.versions[turn.start : turn.end], traj.loss_mask[turn.start : turn.end],
                                         strict=True) if m]  # fmt: skip
            if sampled:
                lag = max(lag, now - min(sampled))
    return lag


class PolicyTrainers:
    """The trainers of a multi-policy run behind one `Trainer` (see the module docstring).

    `trainers` holds every policy that has an adapter (trained ones, and fixed
    ones started from a checkpoint); `trained` names the ones that train.
    """

    def __init__(self, trainers: Mapping[str, Trainer], trained: Sequence[str]) -> None:
        missing = [name for name in trained if name not in trainers]
        if missing:
            raise ValueError(f"trained policies {missing} have no trainer")
        self.trainers = dict(trainers)
        self.trained = list(trained)

    @property
    def policy_version(self) -> int:
        """The newest version among the trained policies (each policy's own: `versions()`)."""
        return max(self.trainers[name].policy_version for name in self.trained)

    def versions(self) -> dict[str, int]:
        """Each trained policy's version now (what its adapter on the engine is tagged with)."""
        return {name: self.trainers[name].policy_version for name in self.trained}

    def train_step(self, groups: Sequence[Group]) -> TrainStepResult:
        """One update of each trained policy on its own turns of the batch (roles normalised apart)."""
        by_role = split_roles(groups)
        per_policy: dict[str, dict[str, float]] = {}
        stats: dict[str, Any] = {}
        for name in self.trained:
            mine = policy_groups(by_role, name)
            if not mine:
                continue
            result = self.trainers[name].train_step(mine)
            per_policy[name] = result.metrics | {"trajectories": float(sum(len(g.trajectories) for g in mine))}
            for traj_id, token_stats in result.token_stats.items():
                stats.setdefault(traj_id, token_stats)
        return TrainStepResult(_merged(per_policy, self.trained), stats)

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """The same supervised step for every trained policy (a warm start from demonstrations)."""
        return _merged({name: self.trainers[name].sft_step(samples) for name in self.trained}, self.trained)

    def state_for_engines(self) -> WeightSource:
        raise AgentrlError("a multi-policy run syncs one adapter per policy (sync_policies), not one set of weights")

    def save(self, path: str | Path, extra_state: Mapping[str, JSON] | None = None) -> None:
        """One trainer checkpoint per trained policy under `policies/<name>/`."""
        for name in self.trained:
            folder = Path(path) / POLICIES_DIR / name
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.trainers[name].save(folder, extra_state)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore every trained policy from `save`'s layout; the extra state of the first."""
        extra: dict[str, Any] | None = None
        for name in self.trained:
            folder = Path(path) / POLICIES_DIR / name
            if not folder.is_dir():
                raise AgentrlError(f"checkpoint {path} has no policy {name!r} (it holds "
                                   f"{sorted(p.name for p in (Path(path) / POLICIES_DIR).glob('*'))})")
            loaded = self.trainers[name].load(folder)
            extra = loaded if extra is None else extra
        return extra or {}

    def close(self) -> None:
        for trainer in self.trainers.values():
            if isinstance(trainer, ClosableTrainer):
                trainer.close()


def _merged(per_policy: Mapping[str, Mapping[str, float]], order: Sequence[str]) -> dict[str, float]:
    """`policy/<name>/<key>` for every policy's metrics, and each key's mean over the policies under the key."""
    out: dict[str, float] = {}
    keys: dict[str, list[float]] = {}
    for name in order:
        for key, value in per_policy.get(name, {}).items():
            out[f"policy/{name}/{key}"] = value
            keys.setdefault(key, []).append(value)
    out |= {key: statistics.fmean(values) for key, values in keys.items() if key != "trajectories"}
    out["policies/stepped"] = float(len(per_policy))
    return out


class CanonicalAdapter:
    """A trainer's adapter tensors under canonical names (`canonical_adapter_name`), counted like its source."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]:
        for bucket in self.source.buckets():
            yield [(canonical_adapter_name(name), tensor) for name, tensor in bucket]

    @property
    def sent_bytes(self) -> int:
        return self.source.sent_bytes if isinstance(self.source, CountedWeightSource) else 0

    @property
    def sent_buckets(self) -> int:
        return self.source.sent_buckets if isinstance(self.source, CountedWeightSource) else 0


async def sync_policies(engine: InferenceEngine, trainers: PolicyTrainers, *, only_changed: bool = True) -> dict[str, float]:
    """Hand each policy's adapter to the engine under that policy's version, and check it took.

    A policy whose adapter the engine already holds at its version is skipped
    (`only_changed`): a fixed policy is sent once, a policy that did not step is not resent.
    """
    if not isinstance(engine, AdapterEngine):
        raise ConfigError(f"policies: engine {type(engine).__name__} cannot hold several adapters "
                          "(it is no AdapterEngine); use engine: hf or vllm")
    started = time.perf_counter()
    sent_mb = 0.0
    for name, trainer in trainers.trainers.items():
        version = int(trainer.policy_version)
        if only_changed and engine.adapter_versions.get(name) == version:
            continue
        if not isinstance(trainer, PolicyTrainer) or (spec := trainer.adapter_spec()) is None:
            raise ConfigError(f"policies.{name}: its trainer has no LoRA adapter to hand the engine")
        source = CanonicalAdapter(trainer.adapter_for_engines())
        await engine.update_adapter(name, source, version, spec)
        if engine.adapter_versions.get(name) != version:
            raise AgentrlError(f"engine {type(engine).__name__} holds adapter {name!r} at version "
                               f"{engine.adapter_versions.get(name)} after update_adapter(version={version})")
        sent_mb += source.sent_bytes / 2**20
    metrics = {"time/weight_sync_s": time.perf_counter() - started}
    if sent_mb:
        metrics["weight_sync/mb"] = sent_mb
    return metrics


def build_policy_trainers(config: RunConfig, trainer_cls: Any, model_path: str) -> PolicyTrainers:
    """One trainer per policy that has an adapter: the run's trainer params, then the policy's own.

    The first trainer loads the base; each later one ties its frozen base to the
    first (`PolicyTrainer.share_base_from`), so N policies hold one base copy.
    A policy with `init:` starts from that checkpoint (a trainer checkpoint, or
    a multi-policy one holding `policies/<name>/`).
    """
    trainers: dict[str, Trainer] = {}
    first: Trainer | None = None
    try:
        for name, policy in config.policies.items():
            if policy.opponent is not None or not policy.adapter:
                continue
            params = {**config.trainer.params, **policy.trainer}
            trainer: Trainer = trainer_cls(trainer_cls.Config(**params), model_path)
            trainers[name] = trainer
            if first is None:
                first = trainer
            elif isinstance(trainer, PolicyTrainer) and not trainer.share_base_from(first):
                raise ConfigError(f"policies.{name}: its trainer cannot share the first policy's base "
                                  "(a multi-policy run needs one-process LoRA trainers over one model.path)")
            if policy.init is not None:
                trainer.load(_policy_checkpoint(Path(policy.init), name))
    except BaseException:
        for built in trainers.values():
            if isinstance(built, ClosableTrainer):
                built.close()
        raise
    return PolicyTrainers(trainers, [name for name, p in config.policies.items() if p.train])


def _policy_checkpoint(path: Path, name: str) -> Path:
    """`path` itself when it is a trainer checkpoint, else its `policies/<name>/` folder."""
    nested = path / POLICIES_DIR / name
    if nested.is_dir():
        return nested
    if (path / "trainer_state.pt").is_file():
        return path
    raise ConfigError(f"policies.{name}.init: {path} is neither a trainer checkpoint nor holds {POLICIES_DIR}/{name}/")
