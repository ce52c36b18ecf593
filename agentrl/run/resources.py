"""Expensive objects the envs of one run share: sandboxes, verifiers, reward models.

The rollout manager builds a fresh env per episode; an env that started its
own sandbox pool or verifier worker each time would pay seconds per episode.
Envs instead ask the run's `RunResources` for such objects by a key (their
plugin spec as JSON): the first ask builds the object, later ones get the
same one, and the run closes them all when it ends (`Parts.close`), after the
episodes that use them. There is no module-level cache and no timer.

An env built outside a run (a test, a notebook) gets a private `RunResources`
and closes it with itself (`owned=True`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

CLOSE_TIMEOUT_S = 30.0
"""Seconds one object's `close()` may take when the resources are closed."""


class RunResources:
    """Objects built on first use by key, closed together by `aclose()` (latest first)."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}

    def get(self, key: str, build: Callable[[], T]) -> T:
        """The object under `key`, built by `build()` if there is none yet (or since `aclose()`)."""
        if key not in self._objects:
            self._objects[key] = build()
        obj: T = self._objects[key]
        return obj

    async def aclose(self) -> None:
        """Close every object (sync or async `close()`, each under `CLOSE_TIMEOUT_S`); safe to call twice."""
        objects, self._objects = list(self._objects.values()), {}
        for obj in reversed(objects):
            await close_quietly(obj)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: str) -> bool:
        return key in self._objects


@runtime_checkable
class Closeable(Protocol):
    """A shared object with something to release: `close()`, sync or async (sandboxes, verifiers, a gateway)."""

    def close(self) -> object: ...


async def close_quietly(obj: object) -> None:
    """Call `obj.close()` (sync or async) if it is `Closeable`, under a deadline; its errors are swallowed."""
    if not isinstance(obj, Closeable):
        return
    with contextlib.suppress(Exception):
        result = obj.close()
        if inspect.isawaitable(result):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await result
