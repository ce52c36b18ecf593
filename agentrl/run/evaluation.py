"""Held-out evaluation: mean reward and unbiased pass@k over n samples per task."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentrl.chat.conversation import ChatTokenizer
from agentrl.chat.tokenizers import hermes_content
from agentrl.engines.base import InferenceEngine
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import MIX_MEMBER_KEY, Env, EpisodeDriver, Task, TurnTaking
from agentrl.errors import AgentrlError
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import run_episode
from agentrl.rollout.multi_agent import run_turns
from agentrl.rollout.roster import SINGLE_AGENT, Roster
from agentrl.types import Trajectory


@dataclass(slots=True)
class EvalResult:
    """Scores of one evaluation; `trajectories` are kept for the store."""

    reward_mean: float
    pass_at: dict[int, float]
    n_tasks: int
    n_samples: int
    errors: int
    trajectories: list[Trajectory] = field(default_factory=list)  # the scored one of each sample first
    others: list[Trajectory] = field(default_factory=list)  # the other agents' of multi-agent episodes

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {f"{prefix}reward_mean": self.reward_mean, f"{prefix}errors": float(self.errors)}
        out.update({f"{prefix}pass@{k}": v for k, v in self.pass_at.items()})
        out.update({f"{prefix}{env}/reward_mean": v for env, v in reward_by_env(self.trajectories).items()})
        out.update({f"{prefix}{key}": v for key, v in policy_scores([*self.trajectories, *self.others]).items()})
        return out


def policy_scores(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per policy of a multi-agent evaluation: `policy/<name>/reward_mean`, and `win_rate`/`draw_rate`
    over its games that ended with a winner (`info["outcome"]`, agentrl.rollout.multi_agent)."""
    by_policy: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        policy = t.info.get("policy")
        if isinstance(policy, str):
            by_policy.setdefault(policy, []).append(t)
    out: dict[str, float] = {}
    for name, trajs in sorted(by_policy.items()):
        out[f"policy/{name}/reward_mean"] = sum(t.reward for t in trajs) / len(trajs)
        outcomes = [t.info["outcome"] for t in trajs if "outcome" in t.info]
        if outcomes:
            out[f"policy/{name}/win_rate"] = outcomes.count("win") / len(outcomes)
            out[f"policy/{name}/draw_rate"] = outcomes.count("draw") / len(outcomes)
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
    roster: Roster | None = None,
    engine_for: Callable[[Env, Task], InferenceEngine] | None = None,
) -> EvalResult:
    """Run `n_samples` episodes per task; a sample passes when reward >= threshold.

    A multi-agent env's episode is scored by its first model-played agent's
    trajectory (the others are kept in `EvalResult.others`); `roster` says who
    plays whom (e.g. the trained policy against a fixed opponent). `engine_for`
    gives each episode its own engine in place of `engine` (`oracle_engine`).
    """
    semaphore = asyncio.Semaphore(concurrency)
    roster = roster or Roster()

    async def one(task: Task, t_index: int, index: int) -> list[Trajectory]:
        async with semaphore:
            env = env_factory()
            engine_ = engine
            sample_seed = seed + t_index * n_samples + index  # every episode its own: independent draws
            try:
                if engine_for is not None:
                    engine_ = engine_for(env, task)
                if isinstance(env, EpisodeDriver):  # the `agent` env: its main trajectory scores the episode
                    return await env.drive_episode(
                        task, engine_, tokenizer, config, seed=sample_seed, group_id=str(task["id"]), sample_index=index,
                    )
                if isinstance(env, TurnTaking):
                    return await run_turns(env, task, engine_, tokenizer, config, roster, seed=sample_seed,
                                           group_id=str(task["id"]), sample_index=index)
                return [await run_episode(
                    env, task, engine_, tokenizer, config, seed=sample_seed, group_id=str(task["id"]),
                    sample_index=index, seat=roster.seat(SINGLE_AGENT) if roster.agents else None,
                )]
            finally:
                await env.close()
                if engine_ is not engine:
                    await engine_.close()

    jobs = [one(task, t, i) for t, task in enumerate(tasks) for i in range(n_samples)]
    episodes = list(await asyncio.gather(*jobs))
    trajectories = [e[0] for e in episodes]
    others = [t for e in episodes if "agent" in e[0].info for t in e[1:]]  # not the agent env's branches
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
        others=others,
    )


class NoOracleError(AgentrlError, ValueError):
    """`agentrl eval --oracle` on an env (or task) that has no oracle."""


def oracle_engine(env: Env, task: Task, tokenizer: ChatTokenizer) -> InferenceEngine:
    """An engine that plays `env.oracle(task)` for one episode: each reply in order, as Hermes tool-call
    text (what the env's parser reads back; checked here, so a parser that disagrees fails loudly)."""
    replies = env.oracle(task)
    if not replies:
        raise NoOracleError(f"env {env.episode_name()!r} has no oracle for task {task.get('id')!r}")
    texts = []
    for message in replies:
        text = hermes_content(message)
        parsed = env.parse_action(text)
        if [(c.name, c.arguments) for c in parsed.tool_calls] != [(c.name, c.arguments) for c in message.tool_calls]:
            raise NoOracleError(f"env {env.episode_name()!r}: its parser does not read the oracle's tool calls back "
                                f"from Hermes text ({text[:200]!r})")
        texts.append(text)
    return ScriptedEngine(ScriptedEngine.Config(replies=texts), tokenizer=tokenizer)
