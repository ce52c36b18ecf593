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
import functools
import math
import time
from collections.abc import Awaitable
from typing import NoReturn, TypeVar

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

    For one-off awaits outside an episode's loop (a slot when none is free, an
    env's close); the loop's own awaits share one timer through `Deadlines`.
    """
    async with asyncio.timeout(timeout_s):
        return await aw


class EpisodeTimeout(TimeoutError):
    """The episode's own deadline (`episode_timeout_s`) passed during one of its awaits."""


class Deadlines:
    """The deadlines of one task's awaits, kept by one lazily scheduled timer.

    Before each await that can block, `arm(timeout_s)` sets the deadline of
    that await: ``now + timeout_s``, but never later than the episode deadline.
    Arming costs a clock read and a few stores. The timer is set up only once
    the task has yielded to the event loop (a `call_soon` look at the deadline
    then), so an episode whose awaits never block ends without a timer; after
    that it is rescheduled only when a new deadline is earlier than the armed
    one. When the timer fires and the await in progress has a later deadline,
    the timer moves there; otherwise the task is cancelled and `fail()` turns
    that cancellation into a classified timeout, like `asyncio.timeout` does (a
    cancellation from elsewhere still propagates). Callbacks run only while
    the task is suspended, and every suspension of the episode is an armed
    await, so the deadline they read is that of the await in progress.
    `close()` cancels what is scheduled when the episode is over.
    """

    __slots__ = ("_armed", "_cancelling", "_handle", "_loop", "_task", "clock", "deadline", "episode_deadline", "fired")

    def __init__(self, episode_timeout_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadlines must be used inside an asyncio task")
        self._loop = loop
        self._task = task
        # loop.time() is time.monotonic() on asyncio's own loops: call that directly (a Python call less)
        self.clock = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time
        self._cancelling = task.cancelling()
        self._handle: asyncio.Handle | None = None  # the pending first look, or the timer
        self._armed = math.inf  # when the timer fires; -inf while the first look is pending
        self.episode_deadline = math.inf if episode_timeout_s is None else loop.time() + episode_timeout_s
        self.deadline = math.inf
        self.fired = False

    def arm(self, timeout_s: float) -> float:
        """Set the deadline of the next await to `timeout_s` from now (capped by the episode's); returns now."""
        if self.fired:  # the last await swallowed our cancellation: take it back
            self._absorb()
        now = self.clock()
        deadline = now + timeout_s
        if deadline > self.episode_deadline:
            deadline = self.episode_deadline
        self.deadline = deadline
        if deadline < self._armed:
            self._schedule(deadline)
        return now

    def fail(self, exc: BaseException, kind: ErrorClass, what: str, timeout_s: float) -> NoReturn:
        """Raise what an exception from an armed await means for the episode.

        Our own cancellation becomes `EpisodeTimeout` (the episode deadline was
        the binding one) or a `TIMEOUT` failure of `what`; other exceptions are
        classified with default class `kind`; anything else (an outside
        cancellation, KeyboardInterrupt) propagates unchanged.
        """
        if self.fired:
            self.fired = False
            if self._task.uncancel() <= self._cancelling and isinstance(exc, asyncio.CancelledError):
                if self.deadline >= self.episode_deadline:
                    raise EpisodeTimeout(what) from exc
                raise _Failed(ErrorClass.TIMEOUT, f"{what} timed out after {timeout_s}s") from exc
        if isinstance(exc, TimeoutError):
            raise _Failed(classify(exc, kind), f"{what} timed out after {timeout_s}s") from exc
        if isinstance(exc, Exception):
            raise _Failed(classify(exc, kind), f"{what} failed: {type(exc).__name__}: {exc}") from exc
        raise exc

    def close(self) -> None:
        """Cancel the timer (call when the awaits are over)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed = math.inf
        self.deadline = math.inf
        if self.fired:
            self._absorb()

    def _schedule(self, when: float) -> None:
        """Make sure a timer fires by `when` (the deadline just armed)."""
        if self._handle is None:  # nothing yet: look once the task has yielded to the loop
            self._armed = -math.inf  # that look reads the deadline then: no need to act before
            self._handle = self._loop.call_soon(self._first_look)
            return
        self._handle.cancel()
        self._timer_at(when)

    def _first_look(self) -> None:
        self._handle = None
        self._timer_at(self.deadline)

    def _timer_at(self, when: float) -> None:
        self._armed = when
        self._handle = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        armed = self._armed
        self._handle = None
        self._armed = math.inf
        if self.deadline > armed:  # the await in progress has a later deadline: wait for that one
            self._timer_at(self.deadline)
            return
        self.fired = True
        self._task.cancel()

    def _absorb(self) -> None:
        self.fired = False
        self._task.uncancel()


def episode_seed(seed: int | None, turn: int) -> int | None:
    """The engine seed of one turn: reproducible per (episode seed, turn)."""
    return None if seed is None else (seed * 1_000_003 + turn) % (2**63)


@functools.lru_cache(maxsize=64)
def _sampling_template(
    temperature: float, top_p: float, top_k: int, stop_ids: tuple[int, ...], stop_strings: tuple[str, ...]
) -> Sampling:
    """A validated Sampling for these run-wide settings; each turn derives its own (`Sampling.for_turn`)."""
    return Sampling(max_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=stop_ids,
                    stop_strings=stop_strings, seed=None)


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
    deadlines = Deadlines(config.episode_timeout_s)
    clock = deadlines.clock
    started = clock()
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
    env_timeout = config.env_timeout_s
    gen_timeout = config.generate_timeout_s
    generate = engine.generate
    decode = tokenizer.decode
    parse_action = env.parse_action
    step = env.step
    overlong = config.overlong
    overlong_from = config.max_new_tokens_per_turn - overlong.buffer_tokens if overlong is not None else 0
    overlong_cut = 0.0
    try:
        t = deadlines.arm(env_timeout)
        try:
            opening, reset_info = await env.reset(task, seed=seed)
        except BaseException as e:
            deadlines.fail(e, ErrorClass.ENV, "env.reset", env_timeout)
        env_s += clock() - t
        state_key = reset_info.get("state_key") if reset_info else None  # for the next turn's info
        tools = env.prompt_tools()
        conv = Conversation(tokenizer, opening, tools=tools, budgets=Budgets.from_rollout_config(config))
        turns = conv.turns
        turn = 0
        sampling = _sampling_template(
            sampling_cfg.temperature, sampling_cfg.top_p, sampling_cfg.top_k, eos, tuple(sampling_cfg.stop_strings)
        )
        while True:
            max_new = conv.max_new_tokens()
            if max_new <= 0:
                truncated, reason = True, conv.exhausted() or "max_total_tokens"
                break
            turn_seed = episode_seed(seed, turn)
            if sampling.max_tokens != max_new or sampling.seed != turn_seed:
                sampling = sampling.for_turn(max_new, turn_seed)
            t = deadlines.arm(gen_timeout)
            try:
                completion = await generate(conv.token_ids, sampling)
            except BaseException as e:
                deadlines.fail(e, ErrorClass.ENGINE, "engine.generate", gen_timeout)
            gen_s += clock() - t
            ids = completion.ids
            checksum = sum(completion.logprobs)
            if checksum - checksum != 0.0:  # a NaN or inf logprob: the trainer could not use the episode
                raise _Failed(ErrorClass.ENGINE, "engine.generate returned a non-finite logprob for a sampled token")
            text = decode(ids[:-1] if ids and ids[-1] in eos else ids)
            try:
                action = parse_action(text)
            except Exception as e:
                raise _Failed(classify(e, ErrorClass.FORMAT), f"parse_action failed: {e}") from e
            conv.add_completion(completion, action)
            if state_key is not None:
                turns[-1].info["state_key"] = state_key
                state_key = None
            t = deadlines.arm(env_timeout)
            try:
                result = await step(action)
            except BaseException as e:
                deadlines.fail(e, ErrorClass.ENV, "env.step", env_timeout)
            env_s += clock() - t
            step_reward = result.reward
            if step_reward - step_reward != 0.0:  # NaN or inf: it would poison the group's advantages
                raise _Failed(ErrorClass.REWARD, f"env.step returned a non-finite reward {step_reward!r}")
            if overlong is not None and len(ids) > overlong_from:
                cut = overlong.penalty * min(len(ids) - overlong_from, overlong.buffer_tokens) / overlong.buffer_tokens
                step_reward -= cut
                overlong_cut += cut
            last = turns[-1]
            last.reward = step_reward
            reward += step_reward
            if result.info:
                for key in ("tool_errors", "tool_timeouts"):
                    if key in result.info:
                        last.info[key] = result.info[key]
                state_key = result.info.get("state_key")
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
        if overlong_cut:
            breakdown["overlong"] = -overlong_cut
    except _Failed as e:
        error = EpisodeError(e.kind, str(e), turn=len(conv.turns) if conv else 0)
    except TimeoutError:  # EpisodeTimeout
        error = EpisodeError(
            ErrorClass.TIMEOUT, f"episode exceeded episode_timeout_s={config.episode_timeout_s}",
            turn=len(conv.turns) if conv else 0,
        )
    except Exception as e:  # a contract violation inside the loop (e.g. a template problem)
        error = EpisodeError(ErrorClass.ENV, f"{type(e).__name__}: {e}", turn=len(conv.turns) if conv else 0)
    finally:
        deadlines.close()
    metrics = {
        "turns": float(len(conv.turns)) if conv else 0.0,
        "sampled_tokens": float(conv.num_sampled) if conv else 0.0,
        "wall_s": clock() - started,
        "generate_s": gen_s,
        "env_s": env_s,
    }
    if conv is None:
        messages, token_ids, loss_mask, logprobs, versions, turns = opening, [], [], [], [], []
    else:  # the conversation ends here: the trajectory takes its lists as they are (no copies)
        metrics["retokenization_drift"] = conv.retokenization_drift()
        messages, token_ids, loss_mask = conv.messages, conv.token_ids, conv.loss_mask
        logprobs, versions, turns = conv.logprobs, conv.versions, conv.turns
    return Trajectory(
        task_id=str(task.get("id", "")),
        env=env.episode_name(),
        messages=messages,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        turns=turns,
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
        metrics=metrics,
        prompt_messages=len(opening),
    )
