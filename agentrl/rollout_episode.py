"""One episode: the multi-turn agent loop on a token-exact Conversation.

generate -> parse the reply -> env.step -> append the env's messages -> ...
until the env terminates or truncates, a budget (turns, total tokens) runs out
or the episode deadline passes. Every await has its own deadline. A failure
ends the episode with a classified `EpisodeError` on the trajectory instead of
raising: the rollout manager decides per class what happens next. The reward
is the sum of the step rewards (a ToolEnv puts its final score in the last
step's reward); each turn records the reward of the step that answered it.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

from agentrl.chat import Budgets, ChatTokenizer, Conversation
from agentrl.engines.base import InferenceEngine, Sampling
from agentrl.env import Env, Task
from agentrl.rollout_config import RolloutConfig
from agentrl.types import EpisodeError, ErrorClass, Message, Trajectory

T = TypeVar("T")


class EpisodeFailure(Exception):
    """Raise from an env, tool, sandbox or reward to end the episode with a given error class.

    Any exception with an `error_class` attribute (an ErrorClass or its value)
    is classified the same way, so plugins need not import this module.
    """

    def __init__(self, kind: ErrorClass | str, message: str) -> None:
        super().__init__(message)
        self.error_class = ErrorClass(kind)


def classify(exc: BaseException, default: ErrorClass) -> ErrorClass:
    """The error class of an exception raised at a boundary whose default class is `default`."""
    kind = getattr(exc, "error_class", None)
    if kind is not None:
        try:
            return ErrorClass(kind)
        except ValueError:
            pass
    if isinstance(exc, TimeoutError):
        return ErrorClass.TIMEOUT
    return default


class _Failed(Exception):
    def __init__(self, kind: ErrorClass, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """Await `aw` under a deadline of `timeout_s` (TimeoutError when it passes).

    The coroutine's first step runs before the deadline is armed: one that
    finishes without suspending (a zero-latency engine or env, a free
    semaphore) never pays for a timer, which keeps the rollout loop's overhead
    per env step low. Every await that does suspend runs under the deadline.
    """
    if not isinstance(aw, types.CoroutineType):
        async with asyncio.timeout(timeout_s):
            return await aw
    try:
        first = aw.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    async with asyncio.timeout(timeout_s):
        return await _resume(aw, first)


async def _bounded(aw: Awaitable[T], timeout_s: float, kind: ErrorClass, what: str) -> T:
    """Await `aw` under a deadline (`within`); any failure becomes a classified `_Failed`."""
    try:
        return await within(aw, timeout_s)
    except TimeoutError as e:
        raise _Failed(classify(e, kind), f"{what} timed out after {timeout_s}s") from e
    except Exception as e:
        raise _Failed(classify(e, kind), f"{what} failed: {type(e).__name__}: {e}") from e


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], first: Any) -> Generator[Any, Any, T]:
    """Continue a coroutine whose first step already ran (what `yield from` does)."""
    pending = first
    while True:
        try:
            sent = yield pending
        except BaseException as e:  # cancellation (e.g. the deadline) goes into the coroutine
            try:
                pending = coro.throw(e)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        else:
            try:
                pending = coro.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


def episode_seed(seed: int | None, turn: int) -> int | None:
    """The engine seed of one turn: reproducible per (episode seed, turn)."""
    return None if seed is None else (seed * 1_000_003 + turn) % (2**63)


async def run_episode(
    env: Env,
    task: Task,
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    config: RolloutConfig,
    *,
    seed: int | None = None,
    group_id: str = "",
    sample_index: int = 0,
) -> Trajectory:
    """Run one episode of `env` on `task`; never raises for episode failures (only on cancel)."""
    started = time.perf_counter()
    conv: Conversation | None = None
    opening: list[Message] = []
    reward = 0.0
    breakdown: dict[str, float] = {}
    terminated = truncated = False
    reason: str | None = None
    error: EpisodeError | None = None
    gen_s = env_s = 0.0
    sampling_cfg = config.sampling
    eos = tuple(tokenizer.eos_ids)
    stop_strings = tuple(sampling_cfg.stop_strings)
    try:
        async with asyncio.timeout(config.episode_timeout_s):
            t = time.perf_counter()
            opening, _info = await _bounded(env.reset(task, seed=seed), config.env_timeout_s, ErrorClass.ENV, "env.reset")
            env_s += time.perf_counter() - t
            tools = [tool.schema() for tool in env.tools] or None
            conv = Conversation(tokenizer, opening, tools=tools, budgets=Budgets.from_rollout_config(config))
            turn = 0
            sampling: Sampling | None = None
            while True:
                max_new = conv.max_new_tokens()
                if max_new <= 0:
                    truncated, reason = True, conv.exhausted() or "max_total_tokens"
                    break
                turn_seed = episode_seed(seed, turn)
                if sampling is None or sampling.max_tokens != max_new or sampling.seed != turn_seed:
                    sampling = Sampling(
                        max_tokens=max_new,
                        temperature=sampling_cfg.temperature,
                        top_p=sampling_cfg.top_p,
                        top_k=sampling_cfg.top_k,
                        stop_ids=eos,
                        stop_strings=stop_strings,
                        seed=turn_seed,
                    )
                t = time.perf_counter()
                completion = await _bounded(
                    engine.generate(conv.prompt_ids, sampling), config.generate_timeout_s, ErrorClass.ENGINE,
                    "engine.generate",
                )
                gen_s += time.perf_counter() - t
                ids = completion.ids
                text = tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids)
                try:
                    action = env.parse_action(text)
                except Exception as e:
                    raise _Failed(classify(e, ErrorClass.FORMAT), f"parse_action failed: {e}") from e
                conv.add_completion(completion, action)
                t = time.perf_counter()
                result = await _bounded(env.step(action), config.env_timeout_s, ErrorClass.ENV, "env.step")
                env_s += time.perf_counter() - t
                last = conv.turns[-1]
                last.reward = result.reward
                reward += result.reward
                if result.info:
                    for key in ("tool_errors", "tool_timeouts"):
                        if key in result.info:
                            last.info[key] = result.info[key]
                    extra = result.info.get("reward_breakdown")
                    if isinstance(extra, dict):
                        breakdown.update({str(k): float(v) for k, v in extra.items()})
                turn += 1
                if result.terminated or result.truncated:
                    terminated, truncated = result.terminated, result.truncated
                    reason = None if terminated else str(result.info.get("truncation_reason", "env"))
                    break
                if not conv.add_messages(result.messages):
                    truncated, reason = True, "max_total_tokens"
                    break
    except _Failed as e:
        error = EpisodeError(e.kind, str(e), turn=len(conv.turns) if conv else 0)
    except TimeoutError:
        error = EpisodeError(
            ErrorClass.TIMEOUT, f"episode exceeded episode_timeout_s={config.episode_timeout_s}",
            turn=len(conv.turns) if conv else 0,
        )
    except Exception as e:  # a contract violation inside the loop (e.g. a template problem)
        error = EpisodeError(ErrorClass.ENV, f"{type(e).__name__}: {e}", turn=len(conv.turns) if conv else 0)
    metrics = {
        "turns": float(len(conv.turns)) if conv else 0.0,
        "sampled_tokens": float(sum(conv.loss_mask)) if conv else 0.0,
        "wall_s": time.perf_counter() - started,
        "generate_s": gen_s,
        "env_s": env_s,
    }
    fields: dict[str, Any] = dict(
        reward=0.0 if error else reward,
        reward_breakdown=breakdown,
        terminated=terminated,
        truncated=truncated,
        truncation_reason=reason,
        error=error,
        group_id=group_id,
        sample_index=sample_index,
        seed=seed,
        task=dict(task),
    )
    task_id = str(task.get("id", ""))
    env_name = env.name or type(env).__name__
    if conv is None:
        return Trajectory(task_id=task_id, env=env_name, messages=opening, token_ids=[], loss_mask=[],
                          logprobs=[], versions=[], metrics=metrics, **fields)
    return conv.to_trajectory(task_id=task_id, env=env_name, metrics=metrics, **fields)
