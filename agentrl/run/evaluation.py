"""Held-out evaluation: mean reward and unbiased pass@k over n samples per task."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentrl.chat.conversation import ChatTokenizer
from agentrl.engines.base import InferenceEngine
from agentrl.env import MIX_MEMBER_KEY, Env, EpisodeDriver, Task
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import run_episode
from agentrl.types import Trajectory


@dataclass(slots=True)
class EvalResult:
    """Scores of one evaluation; `trajectories` are kept for the store."""

    reward_mean: float
    pass_at: dict[int, float]
    n_tasks: int
    n_samples: int
    errors: int
    trajectories: list[Trajectory] = field(default_factory=list)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {f"{prefix}reward_mean": self.reward_mean, f"{prefix}errors": float(self.errors)}
        out.update({f"{prefix}pass@{k}": v for k, v in self.pass_at.items()})
        out.update({f"{prefix}{env}/reward_mean": v for env, v in reward_by_env(self.trajectories).items()})
        return out


def reward_by_env(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Mean reward per member env of a mixture (`Trajectory.env` of tasks tagged with MIX_MEMBER_KEY).

    Empty when no trajectory comes from a mixture: a single-env run's
    `reward/mean` already says it all.
    """
    rewards: dict[str, list[float]] = {}
    for t in trajectories:
        if MIX_MEMBER_KEY in t.task:
            rewards.setdefault(t.env, []).append(t.reward)
    return {env: sum(r) / len(r) for env, r in sorted(rewards.items())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


async def evaluate(
    env_factory: Callable[[], Env],
    tasks: Sequence[Task],
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    config: RolloutConfig,
    *,
    n_samples: int = 1,
    ks: Sequence[int] = (1,),
    success_threshold: float = 1.0,
    concurrency: int = 32,
    seed: int = 0,
) -> EvalResult:
    """Run `n_samples` episodes per task; a sample passes when reward >= threshold."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: Task, t_index: int, index: int) -> Trajectory:
        async with semaphore:
            env = env_factory()
            try:  # every episode gets its own seed, so samples are independent draws
                if isinstance(env, EpisodeDriver):  # the `agent` env: its main trajectory scores the episode
                    trajs = await env.drive_episode(
                        task, engine, tokenizer, config, seed=seed + t_index * n_samples + index,
                        group_id=str(task["id"]), sample_index=index,
                    )
                    return trajs[0]
                return await run_episode(
                    env, task, engine, tokenizer, config, seed=seed + t_index * n_samples + index,
                    group_id=str(task["id"]), sample_index=index,
                )
            finally:
                await env.close()

    jobs = [one(task, t, i) for t, task in enumerate(tasks) for i in range(n_samples)]
    trajectories = list(await asyncio.gather(*jobs))
    rewards = [t.reward for t in trajectories]
    pass_at: dict[int, float] = {}
    for k in ks:
        if k > n_samples:
            continue
        scores = []
        for t_index in range(len(tasks)):
            sample = trajectories[t_index * n_samples : (t_index + 1) * n_samples]
            correct = sum(1 for t in sample if t.reward >= success_threshold)
            scores.append(pass_at_k(n_samples, correct, k))
        pass_at[k] = sum(scores) / len(scores)
    return EvalResult(
        reward_mean=sum(rewards) / len(rewards),
        pass_at=pass_at,
        n_tasks=len(tasks),
        n_samples=n_samples,
        errors=sum(1 for t in trajectories if t.error is not None),
        trajectories=trajectories,
    )
