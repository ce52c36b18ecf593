"""A deterministic, resumable stream of training tasks.

Task `i` of a run is always the same task: epochs are reshuffled with a seed
derived from the run seed and the epoch number. Each task handed out is a
shallow copy carrying its stream position under `CURSOR_KEY`, so a finished
group says exactly which position it answered. Resuming a run needs only the
set of positions already stored: the stream first re-issues the positions that
were handed out but never finished (in flight at the crash), then continues
after the highest one. Nothing is skipped and nothing is issued twice.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from agentrl.env import MIX_MEMBER_KEY, Task
from agentrl.errors import AgentrlError

CURSOR_KEY = "_cursor"


class TaskStream:
    """Iterates tasks in a seeded order over endless epochs, resumably."""

    def __init__(self, tasks: Sequence[Task], *, seed: int, shuffle: bool = True) -> None:
        if not tasks:
            raise ValueError("the environment returned no training tasks")
        self._tasks = list(tasks)
        self._seed = seed
        self._shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def task_at(self, position: int) -> Task:
        """The task at a stream position, tagged with that position."""
        epoch, offset = divmod(position, len(self._tasks))
        task = dict(self._tasks[self._order(epoch)[offset]])
        task[CURSOR_KEY] = position
        return task

    def iterate(self, done: Iterable[int] = ()) -> Iterator[Task]:
        """Positions not in `done` below max(done), then everything after it."""
        done_set = set(done)
        start = max(done_set) + 1 if done_set else 0
        for position in range(start):
            if position not in done_set:
                yield self.task_at(position)
        position = start
        while True:
            yield self.task_at(position)
            position += 1

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._tasks)))
            if self._shuffle:
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # keep only the current epoch
        return order


def cursor_of(task: Task) -> int:
    """The stream position a task was issued at."""
    position = task.get(CURSOR_KEY)
    if not isinstance(position, int):
        raise KeyError(f"task {task.get('id')!r} carries no stream position ({CURSOR_KEY})")
    return position


def solved_key(task: Mapping[str, Any]) -> str:
    """The identity of a task for `rollout.skip_solved`: its id, within its mixture member if any."""
    return f"{task.get(MIX_MEMBER_KEY, '')}/{task.get('id', '')}"


class AllTasksSolved(AgentrlError):
    """Every training task has been solved `rollout.skip_solved` times: nothing is left to train on."""


class SolvedTasks:
    """`rollout.skip_solved`: counts each task's solved groups and keeps solved tasks out of the stream.

    A group is solved when every sample's reward reached `threshold`. The
    counts start from the store (`TrajectoryStore.solved_counts`), so a resumed
    run skips what the run had solved. A skipped task's stream position is
    never stored, so a resume issues it again and it is skipped again.
    """

    def __init__(self, times: int, threshold: float, counts: Mapping[str, int], tasks: Iterable[Task]) -> None:
        self.times = times
        self.threshold = threshold
        self._counts = dict(counts)
        self._all = {solved_key(t) for t in tasks}
        self._solved = {key for key in self._all if self._counts.get(key, 0) >= times}
        self.skipped = 0  # tasks skipped since `take_skipped`

    def record(self, task: Mapping[str, Any], rewards: Sequence[float]) -> None:
        """Count a group of `task` (its samples' rewards) that training saw."""
        if rewards and min(rewards) >= self.threshold:
            key = solved_key(task)
            self._counts[key] = count = self._counts.get(key, 0) + 1
            if count >= self.times and key in self._all:
                self._solved.add(key)

    def solved(self) -> int:
        """How many training tasks are skipped from now on."""
        return len(self._solved)

    def filter(self, tasks: Iterator[Task]) -> Iterator[Task]:
        """`tasks` without the solved ones; AllTasksSolved once no training task is left."""
        for task in tasks:
            if self._counts.get(solved_key(task), 0) < self.times:
                yield task
                continue
            self.skipped += 1
            if len(self._solved) >= len(self._all):
                raise AllTasksSolved(
                    f"all {len(self._all)} training tasks were solved {self.times} time(s) (rollout.skip_solved.times); "
                    "nothing is left to train on"
                )

    def take_skipped(self) -> int:
        out, self.skipped = self.skipped, 0
        return out
