"""The rollout manager: many episodes in flight, GRPO groups out, bounded staleness.

`RolloutManager` keeps up to `max_in_flight` episodes running, samples
`group_size` episodes per task and hands finished groups to the trainer
through `groups()`, an async iterator over a bounded buffer. Three gates
decide when a new group may start (docs/rollout.md):

- concurrency: episodes in flight + group_size <= max_in_flight;
- staleness: groups handed over + groups live (running or buffered) <=
  (trainer steps since start + max_staleness + 1) * groups_per_step, so no
  group starts that would be consumed more than max_staleness versions after
  its weights; max_staleness 0 is synchronous on-policy training;
- back-pressure: finished groups not yet taken < queue_groups.

At hand-over a group whose oldest token is more than max_staleness versions
behind the trainer is not given out: its task is re-run. Failed episodes are
handled per error class (drop the group, zero reward, retry up to k times);
one bad episode never stops the others. With dynamic sampling (DAPO), groups
whose rewards are all equal are dropped and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from agentrl.chat.conversation import ChatTokenizer
from agentrl.engines.base import InferenceEngine
from agentrl.env import Env, EpisodeDriver, Task, TurnTaking
from agentrl.rollout.config import FailurePolicy, RolloutConfig
from agentrl.rollout.episode import EpisodeFailure, classify, run_episode
from agentrl.rollout.metrics import EngineBusy, EngineStats, RolloutMetrics
from agentrl.rollout.multi_agent import run_turns
from agentrl.rollout.roster import SINGLE_AGENT, Roster
from agentrl.types import EpisodeError, ErrorClass, Group, Trajectory, new_id

__all__ = ["EpisodeFailure", "RolloutManager", "RolloutStalled", "classify", "run_episode"]

CURSOR_KEY = "_cursor"  # a task's stream position, when the task stream sets one
VERSION_POLL_S = 0.1
"""How often a waiting gate looks at the version source again (it moves without telling the manager)."""


class RolloutStalled(TimeoutError):
    """Nothing moved for `stall_timeout_s`; the message says which gate is closed and why."""


class RolloutManager:
    """Produces GRPO groups concurrently; an async context manager.

    `tasks` is consumed lazily and in order. A task's position is its
    `task["_cursor"]` when present (agentrl.rollout.task_stream), else its index in
    `tasks`. `state()` tells which positions are done, in flight or queued for
    a re-run, so a resumed run neither skips nor repeats a task.

    The staleness gate's clock is `trainer_version()`: by default the policy
    version the engine serves, which moves when a training step's weights
    reach the engine (`agentrl.run.wiring.sync_weights` checks it does), the moment
    a new sample can carry them. Nobody needs to tell the manager. A run of
    several policies passes its own `lag` (each policy's tokens against that
    policy's version) and a `roster` (who plays which agent): a `TurnTaking`
    env's episodes then run per `agentrl.rollout.multi_agent`, one trajectory
    per model-played agent, all in the sample's group.
    """

    def __init__(
        self,
        env_factory: Callable[[], Env],
        tasks: Iterable[Task],
        engine: InferenceEngine,
        tokenizer: ChatTokenizer,
        config: RolloutConfig,
        *,
        trainer_version: Callable[[], int] | None = None,
        lag: Callable[[Group], int] | None = None,
        roster: Roster | None = None,
        seed: int = 0,
        stall_timeout_s: float = 3600.0,
        close_timeout_s: float = 60.0,
    ) -> None:
        self.env_factory = env_factory
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self._tasks: Iterator[Task] = iter(tasks)
        self._trainer_version = trainer_version or (lambda: engine.policy_version)
        self._lag = lag or self._default_lag
        self._roster = roster or Roster()
        self._v0 = self._trainer_version()
        self._handover_version = self._v0  # the version at the last hand-over (rollout/trainer_version)
        self._seed = seed
        self._stall_timeout_s = stall_timeout_s
        self._close_timeout_s = close_timeout_s
        self._changed = asyncio.Event()
        self._ready: deque[tuple[int, Group]] = deque()  # finished groups, bounded by queue_groups
        self._requeued: deque[tuple[int, Task]] = deque()  # tasks to run again (stale at hand-over)
        self._group_tasks: set[asyncio.Task[None]] = set()
        self._producer: asyncio.Task[None] | None = None
        self._next_index = 0
        self._exhausted = False
        self._finished = False
        self._failure: BaseException | None = None
        self._live: dict[int, Task] = {}  # positions running or buffered
        self._done: set[int] = set()  # positions handed over or dropped for good
        self._handed = 0
        self._waiting_put = 0  # finished groups waiting for room in the buffer
        self._episodes = 0  # episodes started and not finished
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._dropped: list[tuple[Group, str]] = []
        self._metrics = RolloutMetrics(
            engine.busy_seconds if isinstance(engine, EngineBusy) else None,
            engine.stats if isinstance(engine, EngineStats) else None,
        )

    # -- public API -----------------------------------------------------------------------

    async def __aenter__(self) -> RolloutManager:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce(), name="agentrl-rollout-producer")

    async def groups(self) -> AsyncIterator[Group]:
        """Finished groups, as the trainer takes them (an async iterator)."""
        self.start()
        while True:
            self._notify()  # the consumer is back: the version may have moved since it took the last group
            item = await self._next_ready()
            if item is None:
                return
            position, group = item
            version = self.trainer_version
            lag = self._lag(group)
            del self._live[position]
            if lag > self.config.max_staleness:
                self._requeued.append((position, group.task))
                self._drop(position, group, "stale", final=False)
                continue
            self._handed += 1
            self._handover_version = version
            self._done.add(position)
            self._metrics.handed_over(group, lag)
            self._notify()
            yield group

    def _default_lag(self, group: Group) -> int:
        """Steps between the group's oldest token and the version the gate counts from (one policy)."""
        oldest = group.oldest_version
        return 0 if oldest is None else self.trainer_version - oldest

    @property
    def trainer_version(self) -> int:
        """The version the staleness gate counts from (the `trainer_version` source, read now)."""
        return self._trainer_version()

    def state(self) -> dict[str, Any]:
        """The resume cursor: positions done, in flight (re-run them) and issued so far."""
        return {
            "done": sorted(self._done),
            "in_flight": sorted({*self._live, *(p for p, _ in self._requeued)}),
            "issued": self._next_index,
            "trainer_version": self.trainer_version,
        }

    def metrics(self) -> dict[str, float]:
        """Metrics since the previous call (per training step)."""
        out = self._metrics.take(queue_depth=len(self._ready), in_flight=self._episodes)
        out["rollout/trainer_version"] = float(self._handover_version)
        return out

    def drain_dropped(self) -> list[tuple[Group, str]]:
        """Groups dropped since the last call, with the reason (e.g. `error:engine`, `dynamic_sampling`)."""
        out, self._dropped = self._dropped, []
        return out

    async def close(self) -> None:
        """Cancel the producer and every in-flight episode; envs are closed by their episodes."""
        self._finished = True
        pending = [t for t in [self._producer, *self._group_tasks] if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            async with asyncio.timeout(self._close_timeout_s):
                await asyncio.gather(*pending, return_exceptions=True)
        self._notify()

    # -- gates ----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        if ready():  # the common case: no timer to arm and cancel
            return
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                while not ready():
                    self._changed.clear()
                    with contextlib.suppress(TimeoutError):  # the version source moves silently: look again
                        async with asyncio.timeout(VERSION_POLL_S):
                            await self._changed.wait()
        except TimeoutError:
            raise RolloutStalled(self._stall_report()) from None

    def _stall_report(self) -> str:
        """What the gates look like, in words: a stalled run says why, not just that it timed out."""
        cfg = self.config
        allowed = self._groups_allowed()
        parts = [f"rollouts made no progress for {self._stall_timeout_s:g}s"]
        if self._handed + len(self._live) >= allowed:
            parts.append(
                f"staleness gate closed: {self._handed} groups handed over and {len(self._live)} live at trainer "
                f"version {self.trainer_version} (started at {self._v0}); max_staleness={cfg.max_staleness} and "
                f"groups_per_step={cfg.groups_per_step} allow {allowed} until the version moves "
                "(a training step whose weights reach the engine moves it)"
            )
        if len(self._ready) + self._waiting_put >= cfg.queue_groups:
            parts.append(f"back-pressure: {len(self._ready)} finished groups not taken (queue_groups={cfg.queue_groups})")
        if self._episodes:
            parts.append(f"{self._episodes} episodes in flight (each bounded by episode_timeout_s)")
        return "; ".join(parts)

    def _groups_allowed(self) -> int:
        """Groups that may have started (handed over or live) at the trainer's current version."""
        cfg = self.config
        return (self.trainer_version - self._v0 + cfg.max_staleness + 1) * cfg.groups_per_step

    def _can_start(self) -> bool:
        cfg = self.config
        concurrency = self._episodes == 0 or self._episodes + cfg.group_size <= cfg.max_in_flight
        staleness = self._handed + len(self._live) < self._groups_allowed()
        back_pressure = len(self._ready) + self._waiting_put < cfg.queue_groups
        return concurrency and staleness and back_pressure

    def _has_next(self) -> bool:
        return bool(self._requeued) or not self._exhausted

    # -- producer and groups --------------------------------------------------------------

    async def _produce(self) -> None:
        try:
            while True:
                await self._wait_until(lambda: (self._has_next() and self._can_start()) or not self._has_next())
                item = self._take_task()
                if item is not None:
                    position, task = item
                    self._live[position] = task
                    self._episodes += self.config.group_size  # counted now: the task starts later
                    t = asyncio.create_task(self._run_group(position, task))
                    self._group_tasks.add(t)
                    t.add_done_callback(self._group_tasks.discard)
                    continue
                # tasks exhausted: wait for the live groups (a stale one may come back)
                await self._wait_until(lambda: not self._live or bool(self._requeued))
                if not self._live and not self._requeued:
                    break
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the task iterator or a gate broke: surface it to the consumer
            self._failure = e
        finally:
            self._finished = True
            self._notify()

    def _take_task(self) -> tuple[int, Task] | None:
        if self._requeued:
            return self._requeued.popleft()
        if self._exhausted:
            return None
        try:
            task = next(self._tasks)
        except StopIteration:
            self._exhausted = True
            return None
        index = self._next_index
        self._next_index += 1
        position = task.get(CURSOR_KEY, index)
        return (position if isinstance(position, int) else index), task

    async def _next_ready(self) -> tuple[int, Group] | None:
        await self._wait_until(lambda: bool(self._ready) or self._finished or self._failure is not None)
        if self._ready:
            self._notify()  # room in the buffer
            return self._ready.popleft()
        if self._failure is not None:
            raise self._failure
        return None

    async def _run_group(self, position: int, task: Task) -> None:
        """Run the group's samples concurrently, then queue the group (or drop it).

        The first sample whose failure policy drops the group stops its siblings.
        """
        group_id = new_id()
        try:
            jobs = [asyncio.create_task(self._sample(position, task, group_id, i)) for i in range(self.config.group_size)]
            index_of = {job: i for i, job in enumerate(jobs)}
            results: dict[int, list[Trajectory]] = {}
            reason: str | None = None
            pending: set[asyncio.Task[tuple[list[Trajectory], bool]]] = set(jobs)
            try:
                while pending and reason is None:
                    # every episode is bounded by its own deadlines; this wait ends when they do
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for job in done:
                        self._episodes -= 1
                        trajs, keep = job.result()
                        results[index_of[job]] = trajs
                        if not keep and reason is None:
                            error = trajs[0].error
                            reason = f"error:{error.kind.value}" if error else "error"
            finally:
                self._episodes -= len(pending)
                self._notify()
                for job in pending:  # dropped early or cancelled: stop the siblings
                    job.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            trajectories = [t for i in sorted(results) for t in results[i]]
            group = Group(task_id=str(task.get("id", "")), trajectories=trajectories, id=group_id, task=dict(task))
            if reason is None and self.config.dynamic_sampling and len(trajectories) > 1 and len(set(group.rewards)) == 1:
                reason = "dynamic_sampling"
            if reason is not None:
                del self._live[position]
                self._drop(position, group, reason, final=True)
                return
            self._waiting_put += 1
            try:
                await self._wait_until(lambda: len(self._ready) < self.config.queue_groups)
            finally:
                self._waiting_put -= 1
            self._ready.append((position, group))
            self._notify()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug, not an episode failure: stop the run loudly
            self._failure = e
            self._notify()

    def _drop(self, position: int, group: Group, reason: str, *, final: bool) -> None:
        """Record a dropped group; `final` marks its task done (else it is re-run)."""
        if final:
            self._done.add(position)
        self._dropped.append((group, reason))
        self._metrics.dropped[reason] += 1
        self._notify()

    async def _sample(self, position: int, task: Task, group_id: str, index: int) -> tuple[list[Trajectory], bool]:
        """One sample of a group in a fresh env, with the failure policy applied: (its trajectories, keep them?).

        One trajectory per episode, except from an episode driver (`EpisodeDriver`, the `agent`
        env): its branch trajectories follow the first, in the same group, with the same fate.
        """
        attempt = 0
        while True:
            seed = (((self._seed * 1_000_003 + position) * 1009 + index) * 31 + attempt) % (2**62)
            async with asyncio.timeout(self._stall_timeout_s):
                await self._slots.acquire()
            try:
                trajs = await self._episode(task, group_id, index, seed)
            finally:
                self._slots.release()
            traj = trajs[0]
            self._metrics.episode(traj)
            if traj.error is None:
                return trajs, True
            policy = self.config.on_error[traj.error.kind]
            if policy is FailurePolicy.ZERO_REWARD:
                for t in trajs:
                    t.reward = 0.0
                return trajs, True
            if policy is not FailurePolicy.RETRY or attempt >= self.config.max_retries:
                return trajs, False
            attempt += 1
            self._metrics.retries += 1

    async def _episode(self, task: Task, group_id: str, index: int, seed: int) -> list[Trajectory]:
        """Build an env, play one episode in it, close it (its close may fail: the episode stands)."""
        try:
            env = self.env_factory()
        except Exception as e:
            return [_failed(task, classify(e, ErrorClass.ENV), f"env_factory failed: {e}", group_id, index, seed)]
        try:
            if isinstance(env, EpisodeDriver):  # the `agent` env runs its own episodes
                trajs: list[Trajectory] = await env.drive_episode(
                    task, self.engine, self.tokenizer, self.config, seed=seed, group_id=group_id, sample_index=index
                )
                return trajs
            if isinstance(env, TurnTaking):  # agents take turns, each played per the roster
                return await run_turns(env, task, self.engine, self.tokenizer, self.config, self._roster, seed=seed,
                                       group_id=group_id, sample_index=index)
            return [await run_episode(
                env, task, self.engine, self.tokenizer, self.config, seed=seed, group_id=group_id, sample_index=index,
                seat=self._roster.seat(SINGLE_AGENT) if self._roster.agents else None,
            )]
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.env_timeout_s):
                    await env.close()


def _failed(task: Task, kind: ErrorClass, message: str, group_id: str, index: int, seed: int) -> Trajectory:
    """A trajectory for an episode that could not even start."""
    return Trajectory(
        task_id=str(task.get("id", "")), env="", messages=[], token_ids=[], loss_mask=[], logprobs=[],
        versions=[], error=EpisodeError(kind, message, turn=0), group_id=group_id, sample_index=index,
        seed=seed, task=dict(task),
    )
