"""The cyclic garbage collector's first-generation threshold during a run.

Python collects its youngest generation every 700 net new container objects
by default. A rollout keeps what it produces alive (finished trajectories wait
for their group, groups wait for the trainer), so in a fast rollout loop those
collections come every few episodes and each one walks the young
trajectories' per-token lists item by item: on the rollout-overhead benchmark
that is about a tenth of the loop's time. A higher threshold makes the
collections rare without holding more garbage than a bounded number of
container objects (reference counting frees everything that is not in a cycle
at once, whatever the threshold).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_threshold(gen0: int) -> Iterator[None]:
    """Set the first generation's collection threshold to `gen0` inside the block (0: leave it).

    The other generations keep theirs; every threshold is restored on exit,
    so a run started in-process (tests, notebooks) leaves the interpreter as it was.
    """
    if gen0 < 0:
        raise ValueError(f"gc threshold must be >= 0, got {gen0}")
    before = gc.get_threshold()
    if gen0:
        gc.set_threshold(gen0, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
