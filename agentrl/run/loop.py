"""The training loop, top to bottom on one screen.

Rollouts run continuously in the background (RolloutManager); this loop takes
finished groups, trains on a batch, pushes the new weights to the engine and
moves the staleness gate. Every group is stored in the same transaction as the
step's metrics and the data cursor, so a crash at any point loses nothing that
was stored and resumes without skipping or repeating a task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.markup import escape

from agentrl.config import RunConfig, dump_config
from agentrl.errors import AgentrlError
from agentrl.rollout.task_stream import AllTasksSolved, SolvedTasks, TaskStream
from agentrl.run.alerts import RunAlerts
from agentrl.run.memory import MemoryProbe, bound_heap_retention
from agentrl.run.metrics_log import MetricsLog, check_loggers
from agentrl.run.policies import split_roles
from agentrl.run.progress import TrainProgress
from agentrl.run.run_dir import RunDir
from agentrl.run.wiring import (
    Parts,
    batch_metrics,
    build_parts,
    rollout_manager,
    run_eval,
    sync_weights,
    warm_start,
)
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import Group

T = TypeVar("T")


@dataclass(slots=True)
class _Attempt:
    """What one start of the run leaves for the next: its directory, and how many restarts came before."""

    run: RunDir | None
    restarts: int = 0


async def train(config: RunConfig, *, resume: Path | None = None) -> Path:
    """Train per `config` (or continue the run at `resume`); returns the run directory.

    A restartable failure (`AgentrlError.restartable`: a trainer rank lost)
    restarts the run from its last checkpoint, with freshly built parts, up to
    `run.max_restarts` times; the resume is the same as `--resume`, so nothing
    stored is lost or trained twice.
    """
    attempt = _Attempt(RunDir.existing(resume) if resume else None)  # a bad --resume fails before the model loads
    while True:
        try:
            return await _train_once(config, attempt)
        except AgentrlError as e:
            if not e.restartable or attempt.run is None or attempt.restarts >= config.run.max_restarts:
                raise
            attempt.restarts += 1
            Console(stderr=True).print(
                f"[bold yellow]restart {attempt.restarts}/{config.run.max_restarts}[/]: {escape(str(e))}; "
                f"resuming {attempt.run.path} from its last checkpoint"
            )


async def _train_once(config: RunConfig, attempt: _Attempt) -> Path:
    """One start of the run: build everything, restore the newest checkpoint, train until done."""
    began = time.monotonic()  # `time/wall_s`: wall clock of this process, model loading included
    check_loggers(config.run.loggers)
    bound_heap_retention()  # freed activations/KV go back to the OS, not to per-thread heap arenas (run.memory)
    parts = build_parts(config)  # a model that cannot be had fails before a run directory is made
    run = attempt.run = attempt.run or RunDir.create(Path(config.run.output_dir), config.run.name)
    run.config_path.write_text(dump_config(config))
    store = TrajectoryStore(run.store_path)
    store.set_run_config(config.model_dump(mode="json"))
    log = MetricsLog(run.path, loggers=config.run.loggers, project="agentrl", name=run.path.name,
                     config=config.model_dump(mode="json"))
    step, retrain = _restore(run, parts, store)
    stored = {g.id for g in retrain}
    if step == 0 and not retrain:
        await warm_start(config, parts, store, log)
    await sync_weights(parts.engine, parts.trainer)
    stream = TaskStream(parts.train_tasks, seed=config.run.seed)
    skip = config.rollout.skip_solved
    solved = (
        SolvedTasks(skip.times, skip.reward, store.solved_counts(skip.reward), parts.train_tasks) if skip else None
    )

    lock = asyncio.Lock()  # a checkpoint never overlaps a train step running in a thread
    alerts = RunAlerts(config.alerts)
    memory = MemoryProbe({"engine": parts.engine, "trainer": parts.trainer})  # `memory/*`, after eval and trim

    def save(at_step: int) -> None:
        run.save_checkpoint(at_step, lambda d: parts.trainer.save(d, {"step": at_step}))

    async def train_on(batch: list[Group], progress: TrainProgress, extra: Callable[[], dict[str, float]]) -> bool:
        """One optimizer step, weight sync, store + metrics + checkpoint; True when the run is done."""
        nonlocal step
        started = time.perf_counter()
        result = await _off_thread(lock, parts.trainer.train_step, split_roles(batch))  # advantages per role
        metrics = result.metrics
        step += 1
        metrics |= await sync_weights(parts.engine, parts.trainer)
        metrics |= extra() | batch_metrics(batch)
        metrics["time/step_s"] = time.perf_counter() - started
        if attempt.restarts:
            metrics["run/restarts"] = float(attempt.restarts)
        fired = alerts.check(metrics)
        metrics |= {f"alerts/{alert.name}": 1.0 for alert in fired}
        for group in batch:
            for traj in group.trajectories:  # the trainer's per-token values, for the replay token view
                if traj.id in result.token_stats:
                    traj.info["token_stats"] = result.token_stats[traj.id]
            if group.id in stored:
                store.set_group_step(group.id, step=step)
            else:
                store.add_group(group, step=step, status="trained")
                if solved is not None:  # a stored group is already in the store's counts
                    solved.record(group.task, group.rewards)
        if solved is not None:
            metrics |= {"rollout/skipped_solved": float(solved.take_skipped()), "tasks/solved": float(solved.solved())}
        store.add_metrics(step, metrics)
        store.commit()
        if config.run.eval_every and step % config.run.eval_every == 0:
            metrics |= await run_eval(config, parts, store, step=step)
        metrics |= _memory(memory, store, step)
        metrics["time/wall_s"] = time.monotonic() - began
        log.write(step, metrics)
        progress.update(step, metrics)
        for alert in fired:
            log.console.print(f"[bold yellow]alert {alert.name}[/] at step {step}: {escape(alert.message)}")
        stop = bool(fired) and config.alerts.action == "stop"
        if step % config.run.save_every == 0 or step >= config.run.steps or stop:
            await _off_thread(lock, save, step)
        if stop:
            raise AgentrlError(
                f"run stopped at step {step} by alert {fired[0].name} (alerts.action=stop): {fired[0].message}; "
                f"checkpoint written; fix the cause, then `agentrl train --resume {run.path}`"
            )
        return step >= config.run.steps

    try:
        with TrainProgress(config.run.steps, start_step=step, console=log.console) as progress:
            if step == 0 and config.run.eval_every:
                evaluated = await run_eval(config, parts, store, step=0) | _memory(memory, store, 0)
                log.write(0, evaluated | {"time/wall_s": time.monotonic() - began})
            size = config.rollout.groups_per_step
            for i in range(0, len(retrain), size):  # stored groups whose update died with a crash
                if await train_on(retrain[i : i + size], progress, dict):
                    return run.path
            tasks = stream.iterate(store.cursors())
            rollouts = rollout_manager(config, parts, solved.filter(tasks) if solved is not None else tasks)
            async with rollouts:
                try:
                    async for batch in _batches(rollouts.groups(), size):
                        done = await train_on(batch, progress, rollouts.metrics)
                        for group, reason in rollouts.drain_dropped():
                            if reason != "stale":  # a stale group's task is sampled again, not consumed
                                store.add_group(group, step=step, status=f"dropped:{reason}")
                                if solved is not None and reason == "dynamic_sampling":
                                    solved.record(group.task, group.rewards)
                        if done:
                            break
                except AllTasksSolved as e:  # the run is complete early: end it like a finished one
                    log.console.print(f"[green]{escape(str(e))}[/]: the run ends at step {step}")
                    await _off_thread(lock, save, step)
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.console.print(f"[yellow]interrupted: writing a checkpoint at step {step}[/]")
        save(step)
        raise
    finally:
        store.close()
        log.close()
        await parts.close()
    return run.path


def _restore(run: RunDir, parts: Parts, store: TrajectoryStore) -> tuple[int, list[Group]]:
    """Load the newest checkpoint; return its step and the stored groups trained after it.

    Those groups' weights died with the crash; they are trained again from the
    store (same trajectories, same order) instead of being sampled again.
    """
    latest = run.latest_checkpoint()
    step = int(parts.trainer.load(latest[1])["step"]) if latest else 0
    return step, store.groups_after(step, status="trained")


def _memory(memory: MemoryProbe, store: TrajectoryStore, step: int) -> dict[str, float]:
    """The step's `memory/*` metrics (its evaluation included), stored for the replay overview."""
    metrics = memory.metrics()
    store.add_metrics(step, metrics)
    store.commit()
    return metrics


async def _batches(live: AsyncIterator[Group], size: int) -> AsyncIterator[list[Group]]:
    """Finished groups, `size` at a time."""
    batch: list[Group] = []
    async for group in live:
        batch.append(group)
        if len(batch) == size:
            yield batch
            batch = []


async def _off_thread(lock: asyncio.Lock, fn: Callable[..., T], *args: object) -> T:
    """Run blocking trainer work in a thread; a cancel waits for it to finish first."""
    async with lock:
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])
            raise
