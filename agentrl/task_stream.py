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
from collections.abc import Iterable, Iterator, Sequence

from agentrl.env import Task

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
