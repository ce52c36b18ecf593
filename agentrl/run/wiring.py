"""Build a run's parts from its config, and the small steps the loop delegates.

`loop.py` stays one screen because everything that is "look up the plugin,
construct it, hand it its own config" lives here. Torch-backed plugins (hf
engine, torch trainer) are imported only when built.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.chat.conversation import ChatTokenizer, HFChatTokenizer
from agentrl.config import RunConfig
from agentrl.engines.base import (
    BaseSharingEngine,
    CountedWeightSource,
    DeltaEngine,
    DeltaWeightSource,
    InferenceEngine,
    WeightSource,
)
from agentrl.engines.models import resolve_model
from agentrl.env import Env, Task
from agentrl.errors import AgentrlError, ConfigError
from agentrl.rollout.manager import RolloutManager
from agentrl.run.demonstrations import demonstration_sample
from agentrl.run.evaluation import EvalResult, evaluate, oracle_engine, reward_by_env
from agentrl.run.metrics_log import MetricsLog
from agentrl.run.policies import PolicyTrainers, build_policy_trainers, policy_lag, roster, sync_policies
from agentrl.run.resources import RunResources
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.trainer import AdapterTrainer, ClosableTrainer, DeltaTrainer, Trainer
from agentrl.types import Group, TrainSample


@dataclass(slots=True)
class Parts:
    """The live objects of one run (built once, closed once)."""

    env_factory: Callable[[], Env]
    probe: Env  # lists the tasks and gives the demonstrations; closed with the run
    train_tasks: list[Task]
    test_tasks: list[Task]
    engine: InferenceEngine
    tokenizer: ChatTokenizer
    trainer: Trainer  # agentrl.trainer.Trainer: the torch trainer, the ray group, or a user's
    resources: RunResources = field(default_factory=RunResources)  # sandboxes, verifiers: shared by the envs

    async def close(self) -> None:
        try:
            await _close_parts(self.engine, self.probe, self.resources)
        finally:
            _close_trainer(self.trainer)


@dataclass(slots=True)
class EvalParts:
    """What an evaluation needs: no trainer."""

    env_factory: Callable[[], Env]
    probe: Env
    test_tasks: list[Task]
    engine: InferenceEngine
    tokenizer: ChatTokenizer
    resources: RunResources = field(default_factory=RunResources)

    async def close(self) -> None:
        await _close_parts(self.engine, self.probe, self.resources)


async def _close_parts(engine: InferenceEngine, probe: Env, resources: RunResources) -> None:
    """Close the engine, then the probe env, then what the envs shared, each even if the one before failed."""
    try:
        await engine.close()
    finally:
        try:
            await probe.close()
        finally:
            await resources.aclose()


def build_parts(config: RunConfig) -> Parts:
    """Construct env factory, tasks, tokenizer, trainer and engine from the config."""
    plugins = config.registry()
    model_path = resolve_model(config.model.path)
    resources = RunResources()
    env_factory, probe = _env(config, resources)
    train_tasks = _tasks(probe, "train", "env")
    if not train_tasks:
        raise ConfigError(f"env {config.env.name!r} has no tasks in its train split")
    test_tasks = _eval_tasks(config, probe, needed=bool(config.run.eval_every))  # found out now, not later
    tokenizer = HFChatTokenizer.from_pretrained(model_path)
    trainer_cls = plugins.registry("trainers").get(config.trainer.name)
    trainer: Trainer
    if config.policies:  # several policies: one trainer each, over one base (agentrl.run.policies)
        trainer = build_policy_trainers(config, trainer_cls, model_path)
    else:
        trainer = trainer_cls(config.trainer.config or trainer_cls.Config(**config.trainer.params), model_path)
    try:
        engine = _engine(config, model_path, tokenizer)
    except BaseException:
        _close_trainer(trainer)
        raise
    if isinstance(engine, BaseSharingEngine):  # hf engine + LoRA trainer in one process: one base copy
        first = next(iter(trainer.trainers.values())) if isinstance(trainer, PolicyTrainers) else trainer
        engine.share_base_with(first)
    return Parts(env_factory, probe, train_tasks, test_tasks, engine, tokenizer, trainer, resources)


def _close_trainer(trainer: Trainer) -> None:
    """End a trainer that runs processes of its own (the `ray` group: its optional `close()`)."""
    if isinstance(trainer, ClosableTrainer):
        trainer.close()


def build_engine_only(config: RunConfig) -> EvalParts:
    """Env, held-out tasks, tokenizer and engine (for `agentrl eval`)."""
    model_path = resolve_model(config.model.path)
    resources = RunResources()
    env_factory, probe = _env(config, resources)
    test_tasks = _eval_tasks(config, probe, needed=True)
    tokenizer = HFChatTokenizer.from_pretrained(model_path)
    return EvalParts(env_factory, probe, test_tasks, _engine(config, model_path, tokenizer), tokenizer, resources)


def _env(config: RunConfig, resources: RunResources) -> tuple[Callable[[], Env], Env]:
    """The env factory and one probe env (it lists the tasks; the caller closes it).

    Every env gets the run's plugins and `resources`: what its config names is found
    in the run's registry, and its sandboxes and verifiers are the run's, closed with it.
    """
    plugins = config.registry()

    def env_factory() -> Env:
        return plugins.create_env(config.env.name, config.env.params, resources=resources)

    return env_factory, env_factory()


def _eval_tasks(config: RunConfig, probe: Env, *, needed: bool) -> list[Task]:
    """The held-out tasks of the run's eval settings; none at all is an error when they are `needed`."""
    tasks = _tasks(probe, config.run.eval_split, "run.eval_split")[: config.run.eval_tasks]
    if needed and not tasks:
        raise ConfigError(f"run.eval_split: env {config.env.name!r} has no tasks in split {config.run.eval_split!r}")
    return tasks


def _tasks(env: Env, split: str, key: str) -> list[Task]:
    """The tasks of one split; an env's complaint about the split (an unknown name) is a config error."""
    try:
        return list(env.tasks(split))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{key}: split {split!r}: {e}") from None


def _engine(config: RunConfig, model_path: str, tokenizer: ChatTokenizer) -> InferenceEngine:
    """The engine serves exactly the weights the trainer starts from (`model.path`)."""
    plugins = config.registry()

    def fields_of(name: str) -> set[str]:
        return set(plugins.engines.get(name).Config.model_fields)

    params = engine_params(config, model_path, fields_of(config.engine.name), replica_fields=fields_of)
    engine: InferenceEngine = plugins.create_engine(config.engine.name, params, tokenizer=tokenizer)
    return engine


def engine_params(
    config: RunConfig, model_path: str, fields: set[str], *, replica_fields: Callable[[str], set[str]] | None = None
) -> dict[str, Any]:
    """The engine section's params, plus what the run knows for an engine that has the field: `model`
    (the trainer's starting weights) and, unless given, `lora_rank` (the LoRA layers an engine makes when it
    starts: sized for the trainer's adapter, a sync is the adapter alone). A pool's replicas (the `replica`
    section of a ray pool) get the same `lora_rank` when their engine has one (`replica_fields(name)`)."""
    params = dict(config.engine.params)
    if "model" in fields:
        params["model"] = model_path
    rank = trainer_lora_rank(config)
    validated = config.engine.config
    given = validated.model_fields_set if validated is not None else set(params)  # what the user wrote
    if "lora_rank" in fields and "lora_rank" not in given and rank:
        params["lora_rank"] = rank
    spec = params.get("replica")
    if rank and replica_fields is not None and isinstance(spec, dict):
        inner = dict(spec.get("params") or {})
        if "lora_rank" in replica_fields(str(spec.get("name", "hf"))) and "lora_rank" not in inner:
            params["replica"] = {**spec, "params": {**inner, "lora_rank": rank}}
    return params


def trainer_lora_rank(config: RunConfig) -> int:
    """The largest LoRA rank the run trains (`trainer.lora.r`, or any policy's), 0 without LoRA."""
    sections = [config.trainer.params, *({**config.trainer.params, **p.trainer} for p in config.policies.values())]
    ranks = [int((s.get("lora") or {}).get("r", 0) or 0) for s in sections if isinstance(s.get("lora") or {}, dict)]
    return max(ranks, default=0)


async def sync_weights(engine: InferenceEngine, trainer: Trainer) -> dict[str, float]:
    """Push the trainer's current weights to the engine, check the engine took them, and measure the push.

    The check is the version handshake: after `update_weights(w, v)` the
    engine must serve `v`. An engine whose update silently did nothing would
    otherwise keep sampling old weights under new version tags. Returns
    `time/weight_sync_s`, plus `weight_sync/mb`, `weight_sync/mb_per_s` and
    `weight_sync/buckets` when the weight source counts what it handed out.
    An engine that shares the trainer's frozen base (`weights_wanted == "adapter"`,
    agentrl.engines.hf_shared) is handed the adapter alone, unmerged.
    A multi-policy run hands each policy's adapter over instead (`sync_policies`).
    """
    if isinstance(trainer, PolicyTrainers):
        return await sync_policies(engine, trainer)
    source = weights_for(engine, trainer)
    version = int(trainer.policy_version)
    started = time.perf_counter()
    await engine.update_weights(source, version)
    took = time.perf_counter() - started
    if engine.policy_version != version:
        raise AgentrlError(
            f"engine {type(engine).__name__} serves policy version {engine.policy_version} after "
            f"update_weights(version={version}): the update did not take, and its samples would carry the wrong weights"
        )
    metrics = {"time/weight_sync_s": took}
    if isinstance(source, CountedWeightSource) and source.sent_bytes > 0:
        mb = source.sent_bytes / 2**20
        metrics |= {"weight_sync/mb": mb, "weight_sync/mb_per_s": mb / max(took, 1e-9),
                    "weight_sync/buckets": float(source.sent_buckets)}  # fmt: skip
    if isinstance(source, DeltaWeightSource):
        metrics |= {"weight_sync/delta_ratio": source.ratio, "weight_sync/delta_full": float(source.full)}
    return metrics


def weights_for(engine: InferenceEngine, trainer: Trainer) -> WeightSource:
    """What a sync hands `engine`: the adapter alone to an engine that samples with the trainer's own base,
    only the changed elements to one that takes a delta from a trainer with `delta_sync`, else the whole model."""
    if isinstance(engine, BaseSharingEngine) and engine.weights_wanted == "adapter" and isinstance(trainer, AdapterTrainer):
        return trainer.adapter_for_engines()
    dtype = engine.weights_dtype() if isinstance(engine, DeltaEngine) else None
    if dtype is not None and isinstance(trainer, DeltaTrainer):
        delta = trainer.delta_for_engines(int(engine.policy_version), dtype)
        if delta is not None:
            return delta
    return trainer.state_for_engines()


def rollout_manager(config: RunConfig, parts: Parts, tasks: Iterable[Task]) -> RolloutManager:
    """The run's rollout manager; its episode seeds derive from `run.seed` (other seed, other samples).

    Its staleness gate follows the policy version the engine serves: `sync_weights` moves it after each step.
    """
    if not isinstance(parts.trainer, PolicyTrainers):
        return RolloutManager(
            parts.env_factory, tasks, parts.engine, parts.tokenizer, config.rollout, seed=config.run.seed,
        )
    trainers = parts.trainer  # several policies: each policy's tokens age against its own version
    return RolloutManager(
        parts.env_factory, tasks, parts.engine, parts.tokenizer, config.rollout, seed=config.run.seed,
        trainer_version=lambda: trainers.policy_version, lag=lambda g: policy_lag(g, trainers.versions()),
        roster=roster(config),
    )


def batch_metrics(batch: Sequence[Group]) -> dict[str, float]:
    """Reward statistics of the batch just trained on (its staleness is the trainer's `staleness/*`)."""
    rewards = [t.reward for g in batch for t in g.trajectories]
    out = {
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "batch/groups": float(len(batch)),
        "batch/trajectories": float(len(rewards)),
        "batch/sampled_tokens": float(sum(t.num_sampled_tokens for g in batch for t in g.trajectories)),
    }
    out.update({f"reward/mean/{env}": v for env, v in reward_by_env([t for g in batch for t in g.trajectories]).items()})
    return out


async def evaluate_config(config: RunConfig, parts: Parts | EvalParts, *, oracle: bool = False) -> EvalResult:
    """Evaluate on the held-out tasks with the run's eval settings (`run.eval_temperature` over the rollout's);
    with `oracle`, each episode is played by the env's oracle (`Env.oracle`) instead of the engine."""
    rollout = config.rollout
    if config.run.eval_temperature is not None:
        sampling = rollout.sampling.model_copy(update={"temperature": config.run.eval_temperature})
        rollout = rollout.model_copy(update={"sampling": sampling})
    return await evaluate(
        parts.env_factory,
        parts.test_tasks,
        parts.engine,
        parts.tokenizer,
        rollout,
        n_samples=config.run.eval_samples,
        ks=sorted({1, config.run.eval_samples}),
        seed=config.run.seed,
        roster=roster(config, evaluation=True),
        engine_for=(lambda env, task: oracle_engine(env, task, parts.tokenizer)) if oracle else None,
    )


async def run_eval(config: RunConfig, parts: Parts, store: TrajectoryStore, *, step: int) -> dict[str, float]:
    """Score the current policy on held-out tasks; store the episodes as status 'eval'."""
    result = await evaluate_config(config, parts)
    for traj in [*result.trajectories, *result.others]:
        store.add_trajectory(traj, step=step, status="eval")
    metrics = result.metrics()
    store.add_metrics(step, metrics)  # beside the step's training metrics: the replay overview reads them
    store.commit()
    return metrics


async def warm_start(config: RunConfig, parts: Parts, store: TrajectoryStore, log: MetricsLog) -> None:
    """Optional SFT before RL: on the env's demonstrations, or a past run's good episodes."""
    ws = config.warm_start
    if ws.steps == 0:
        return
    samples = _warm_start_samples(config, parts)
    if not samples:
        raise ValueError(f"warm_start.source={ws.source!r} gave no training samples")
    for i in range(ws.steps):
        batch = [samples[(i * ws.batch_size + j) % len(samples)] for j in range(ws.batch_size)]
        metrics = parts.trainer.sft_step(batch)
        log.write(-ws.steps + i, {k if k.startswith("sft/") else f"sft/{k}": v for k, v in metrics.items()})
    log.console.print(f"warm start: {ws.steps} SFT steps on {len(samples)} samples ({ws.source})")


def _warm_start_samples(config: RunConfig, parts: Parts) -> list[TrainSample]:
    ws = config.warm_start
    if ws.source == "store":
        if ws.store_path is None:
            raise ValueError("warm_start.store_path is required when warm_start.source is 'store'")
        old = TrajectoryStore(ws.store_path, readonly=True)
        try:
            return [r.trajectory.tokens() for r in old.iter_records() if r.trajectory.reward >= ws.min_reward]
        finally:
            old.close()
    return [  # rendered with the tools the env's episodes render
        demonstration_sample(parts.tokenizer, demo, tools=tools)
        for tools, demos in parts.probe.demonstration_sets()
        for demo in demos
    ]
