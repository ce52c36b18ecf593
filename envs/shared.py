"""Expensive objects (sandboxes, verifiers, reward models) shared by the envs of one event loop.

The rollout manager builds a fresh env per episode and closes it afterwards;
an env that started its own sandbox pool, verifier worker process or reward
model each time would pay seconds per episode. Envs instead `acquire` such
objects by a key (their plugin spec as JSON) and `release` them on close. The
object is built on first acquire and closed `linger_s` seconds after its last
release (so the gaps between training steps do not rebuild it), or when its
event loop shuts down: a lingering close is a task, and `asyncio.run`
cancels tasks at exit, which runs the close.

State is per event loop (the objects hold loop-bound pipes and futures), kept
in a weak map so a finished loop leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_LINGER_S = 30.0


@dataclass(slots=True)
class _Entry:
    obj: Any
    refs: int = 0
    closer: asyncio.Task[None] | None = field(default=None)


class SharedObjects:
    """Ref-counted objects of one event loop, built on demand, closed after a linger."""

    def __init__(self, linger_s: float = DEFAULT_LINGER_S) -> None:
        self.linger_s = linger_s
        self._entries: dict[str, _Entry] = {}

    def acquire(self, key: str, build: Callable[[], Any]) -> Any:
        """The object under `key`, built now if there is none; pair with `release(key)`."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(build())
        if entry.closer is not None:
            entry.closer.cancel()
            entry.closer = None
        entry.refs += 1
        return entry.obj

    def release(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.refs == 0:
            raise KeyError(f"release({key!r}) without a matching acquire")
        entry.refs -= 1
        if entry.refs == 0:
            entry.closer = asyncio.get_running_loop().create_task(self._close_later(key, entry))

    async def aclose(self) -> None:
        """Close every object now, in use or not (end of a run)."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if entry.closer is not None:
                entry.closer.cancel()
            await close_quietly(entry.obj)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    async def _close_later(self, key: str, entry: _Entry) -> None:
        try:
            await asyncio.sleep(self.linger_s)
        except asyncio.CancelledError:
            if entry.refs > 0:  # re-acquired: keep it
                raise
        if self._entries.get(key) is entry and entry.refs == 0:
            del self._entries[key]
            await close_quietly(entry.obj)


async def close_quietly(obj: Any) -> None:
    """Call `obj.close()` (sync or async) if it has one, under a deadline."""
    close = getattr(obj, "close", None)
    if close is None:
        return
    with contextlib.suppress(Exception):
        result = close()
        if inspect.isawaitable(result):
            async with asyncio.timeout(30):
                await result


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SharedObjects] = weakref.WeakKeyDictionary()


def shared_objects() -> SharedObjects:
    """The shared objects of the running event loop."""
    loop = asyncio.get_running_loop()
    objects = _PER_LOOP.get(loop)
    if objects is None:
        objects = _PER_LOOP[loop] = SharedObjects()
    return objects
