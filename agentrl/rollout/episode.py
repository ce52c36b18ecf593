"""One episode: the multi-turn agent loop on a token-exact Conversation.

generate -> parse the reply -> env.step -> append the env's messages -> ...
until the env terminates or truncates, a budget (turns, total tokens) runs out
or the episode deadline passes. Every await has its own deadline: the
episode runs inside one `asyncio.timeout`, rescheduled before each call to
that call's deadline (never past the episode's). A failure ends the episode with a
classified `EpisodeError` on the trajectory instead of raising: the rollout
manager decides per class what happens next. The reward is the sum of the
step rewards (a ToolEnv puts its final score in the last step's reward); each
turn records the reward of the step that answered it.

Episode failure has four names, one job each (docs/rollout.md "Failures"):
`ErrorClass` says what failed, `EpisodeFailure` is the exception that ends an
episode with a class, `EpisodeError` is the record stored on the trajectory,
and `FailurePolicy` (config `rollout.on_error`) says what the manager does.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol, TypeVar, runtime_checkable

from agentrl.chat.conversation import Budgets, ChatTokenizer, Conversation
from agentrl.engines.base import InferenceEngine, Sampling
from agentrl.env import Env, Task
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.roster import Seat
from agentrl.types import Completion, EpisodeError, ErrorClass, Message, Trajectory

T = TypeVar("T")


@runtime_checkable
class ClassifiedError(Protocol):
    """An exception that names its own error class (`EpisodeFailure`, or a plugin's own exception).

    `error_class` is an `ErrorClass` or its value; plugins need not import this module to have one.
    """

    error_class: ErrorClass | str


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
    if isinstance(exc, ClassifiedError):
        try:
            return ErrorClass(exc.error_class)
        except ValueError:
            pass
    if isinstance(exc, TimeoutError):
        return ErrorClass.TIMEOUT
    return default


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
    seat: Seat | None = None,
) -> Trajectory:
    """Run one episode of `env` on `task`; never raises for episode failures (only on cancel).

    `seat` says which policy plays (a multi-policy run's `Roster`): its turns are
    sampled with the seat's adapter and record its policy (`Turn.policy`).
    """
    episode = EpisodeState(env, task, engine, tokenizer, config, seed)
    episode.seat = seat
    error = await play(episode)
    return episode.trajectory(error, group_id=group_id, sample_index=sample_index)


async def play(episode: EpisodeState) -> EpisodeError | None:
    """Play `episode` under its deadline; the classified failure that ended it, or None."""
    try:
        async with asyncio.timeout(episode.config.episode_timeout_s) as episode.timer:
            await episode.run()
    except EpisodeFailure as e:
        return EpisodeError(e.error_class, str(e), turn=episode.turns())
    except TimeoutError:  # the deadline of the call in progress, or the episode's
        return EpisodeError(ErrorClass.TIMEOUT, episode.timed_out(), turn=episode.turns())
    except Exception as e:  # a contract violation inside the loop (e.g. a template problem)
        return EpisodeError(ErrorClass.ENV, f"{type(e).__name__}: {e}", turn=episode.turns())
    return None


def sampling_template(config: RolloutConfig, tokenizer: ChatTokenizer) -> Sampling:
    """The run-wide sampling settings of `config` (stop at the tokenizer's eos); each turn derives its own."""
    s = config.sampling
    return _sampling_template(s.temperature, s.top_p, s.top_k, tuple(tokenizer.eos_ids), tuple(s.stop_strings))


def decode_action(env: Env, tokenizer: ChatTokenizer, completion: Completion) -> Message:
    """The env's action for a completion: its text without the closing eos, through `env.parse_action`.

    A non-finite logprob (the trainer could not use the episode) and a parse
    failure end the episode with their error class.
    """
    if not all(map(math.isfinite, completion.logprobs)):
        raise EpisodeFailure(ErrorClass.ENGINE, "engine.generate returned a non-finite logprob for a sampled token")
    ids = completion.ids
    eos = tokenizer.eos_ids
    text = tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids)
    try:
        return env.parse_action(text)
    except Exception as e:
        raise EpisodeFailure(classify(e, ErrorClass.FORMAT), f"parse_action failed: {e}") from e


class EpisodeState:
    """The state of one running episode; `run()` plays it, `trajectory()` packs the result."""

    def __init__(
        self, env: Env, task: Task, engine: InferenceEngine, tokenizer: ChatTokenizer, config: RolloutConfig,
        seed: int | None,
    ) -> None:
        self.env, self.task, self.engine, self.tokenizer, self.config, self.seed = (
            env, task, engine, tokenizer, config, seed
        )
        self.started = time.monotonic()
        self.conv: Conversation | None = None
        self.opening: list[Message] = []
        self.reward = 0.0
        self.breakdown: dict[str, float] = {}
        self.terminated = self.truncated = False
        self.reason: str | None = None
        self.gen_s = self.env_s = 0.0
        self.timer: asyncio.Timeout | None = None  # the episode's timeout, entered by run_episode
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.episode_end = self.clock() + config.episode_timeout_s
        self.call: tuple[str, float, float] = ("", 0.0, self.episode_end)  # what, its limit, its deadline
        self.seat: Seat | None = None  # who plays (a multi-policy run's roster); None: the engine's own weights

    def turns(self) -> int:
        return len(self.conv.turns) if self.conv is not None else 0

    async def bounded(self, aw: Awaitable[T], timeout_s: float, kind: ErrorClass, what: str) -> T:
        """Await one boundary call (`what`: "env.step", ...) under its own deadline.

        The episode's timer moves to this call's deadline (never past the
        episode's). The call's exception becomes an `EpisodeFailure` classified
        with default class `kind`; a cancellation passes through unchanged (the
        timer's becomes a TimeoutError in `run_episode`, see `timed_out`).
        """
        assert self.timer is not None, "bounded() runs inside run_episode's timeout"
        if self.timer.expired():  # the previous call swallowed the cancellation: its deadline still counts
            if isinstance(aw, Coroutine):
                aw.close()  # never started
            raise TimeoutError
        deadline = min(self.clock() + timeout_s, self.episode_end)
        self.call = (what, timeout_s, deadline)
        self.timer.reschedule(deadline)
        try:
            return await aw
        except TimeoutError as e:  # the call's own (not the timer's: that one arrives as a cancellation)
            raise EpisodeFailure(classify(e, kind), f"{what} timed out after {timeout_s}s") from e
        except Exception as e:
            raise EpisodeFailure(classify(e, kind), f"{what} failed: {type(e).__name__}: {e}") from e

    def timed_out(self) -> str:
        """Which deadline passed: the call's in progress, or the whole episode's."""
        what, timeout_s, deadline = self.call
        if deadline < self.episode_end:
            return f"{what} timed out after {timeout_s}s"
        return f"episode exceeded episode_timeout_s={self.config.episode_timeout_s}"

    async def run(self) -> None:
        env, config = self.env, self.config
        seat = self.seat or Seat()
        t = time.monotonic()
        reset = env.reset(self.task, seed=self.seed)
        self.opening, _ = await self.bounded(reset, config.env_timeout_s, ErrorClass.ENV, "env.reset")
        self.env_s += time.monotonic() - t
        state_key = env.state_key()  # the state the next turn acts on
        conv = self.conv = Conversation(
            self.tokenizer, self.opening, tools=env.prompt_tools(), budgets=Budgets.from_rollout_config(config)
        )
        sampling = sampling_template(config, self.tokenizer).with_adapter(seat.adapter)
        overlong = config.overlong
        overlong_from = config.max_new_tokens_per_turn - overlong.buffer_tokens if overlong is not None else 0
        overlong_cut = 0.0
        for turn in itertools.count():  # until the env ends it or a budget (max_turns included) runs out
            max_new = conv.max_new_tokens()
            if max_new <= 0:
                self.truncated, self.reason = True, conv.exhausted() or "max_total_tokens"
                break
            sampling = sampling.for_turn(max_new, episode_seed(self.seed, turn))
            t = time.monotonic()
            generate = self.engine.generate(conv.token_ids, sampling)
            completion = await self.bounded(generate, config.generate_timeout_s, ErrorClass.ENGINE, "engine.generate")
            self.gen_s += time.monotonic() - t
            ids = completion.ids
            action = decode_action(env, self.tokenizer, completion)
            conv.add_completion(completion, action)
            last = conv.turns[-1]
            last.policy = seat.policy
            if state_key is not None:
                last.info["state_key"] = state_key
            t = time.monotonic()
            result = await self.bounded(env.step(action), config.env_timeout_s, ErrorClass.ENV, "env.step")
            self.env_s += time.monotonic() - t
            step_reward = result.reward
            if not math.isfinite(step_reward):  # it would poison the group's advantages
                raise EpisodeFailure(ErrorClass.REWARD, f"env.step returned a non-finite reward {step_reward!r}")
            if overlong is not None and len(ids) > overlong_from:
                cut = overlong.penalty * min(len(ids) - overlong_from, overlong.buffer_tokens) / overlong.buffer_tokens
                step_reward -= cut
                overlong_cut += cut
            last.reward = step_reward
            self.reward += step_reward
            if result.tool_errors is not None:
                last.info["tool_errors"] = result.tool_errors
            if result.tool_timeouts is not None:
                last.info["tool_timeouts"] = result.tool_timeouts
            self.breakdown.update({str(k): float(v) for k, v in result.reward_breakdown.items()})
            state_key = env.state_key()
            if result.terminated or result.truncated:
                self.terminated, self.truncated = result.terminated, result.truncated
                self.reason = None if result.terminated else (result.truncation_reason or "env")
                break
            if not conv.add_messages(result.messages):
                self.truncated, self.reason = True, "max_total_tokens"
                break
        if overlong_cut:
            self.breakdown["overlong"] = -overlong_cut

    def trajectory(self, error: EpisodeError | None, *, group_id: str, sample_index: int) -> Trajectory:
        """The finished episode as a Trajectory (the conversation's tokens, or none if it never started)."""
        fields: dict[str, Any] = {
            "reward": 0.0 if error else self.reward,
            "reward_breakdown": self.breakdown,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "truncation_reason": self.reason,
            "error": error,
            "group_id": group_id,
            "sample_index": sample_index,
            "seed": self.seed,
            "task": dict(self.task),
        }
        task_id, env_name = str(self.task.get("id", "")), self.env.episode_name()
        metrics = {
            "turns": float(self.turns()),
            "sampled_tokens": float(self.conv.num_sampled) if self.conv is not None else 0.0,
            "wall_s": time.monotonic() - self.started,
            "generate_s": self.gen_s,
            "env_s": self.env_s,
        }
        if self.conv is None:
            return Trajectory(task_id=task_id, env=env_name, messages=self.opening, token_ids=[], loss_mask=[],
                              logprobs=[], versions=[], metrics=metrics, prompt_messages=len(self.opening), **fields)
        return self.conv.to_trajectory(task_id=task_id, env=env_name, metrics=metrics, **fields)
