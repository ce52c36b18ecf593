"""A small pool of worker *processes* with a hard per-call timeout.

Verifiers such as math-verify use ``SIGALRM`` timeouts, which only work in a
process's main thread: called from a thread pool they silently fail (a known
cause of all-zero rewards elsewhere). Here every call runs in the main thread
of a separate process, and the caller awaits it without blocking the event
loop; a call that overruns its deadline gets its process killed (SIGKILL, so
even a C-level hang ends) and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any


def _serve() -> None:
    """Worker main loop: length-prefixed pickles on stdin/stdout."""
    import pickle
    import struct
    import sys

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol

    def send(obj: object) -> None:
        data = pickle.dumps(obj)
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()

    for module in sys.argv[1:]:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    send(("ready", None))
    while True:
        hdr = inp.read(4)
        if len(hdr) < 4:
            return
        fn, args = pickle.loads(inp.read(struct.unpack(">I", hdr)[0]))
        try:
            send(("ok", fn(*args)))
        except BaseException as e:
            send(("error", f"{type(e).__name__}: {e}"))


class WorkerError(Exception):
    """The function raised inside the worker (message carries type and text)."""


class _Worker:
    """One ``python -m agentrl.sandboxes.verifiers.workers`` process (no multiprocessing:
    it would re-import the caller's ``__main__``)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, preload: tuple[str, ...]) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentrl.sandboxes.verifiers.workers", *preload,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def send(self, obj: object) -> None:
        data = pickle.dumps(obj)
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        await self.proc.stdin.drain()

    async def recv(self) -> tuple[str, Any]:
        assert self.proc.stdout is not None
        n = struct.unpack(">I", await self.proc.stdout.readexactly(4))[0]
        msg: tuple[str, Any] = pickle.loads(await self.proc.stdout.readexactly(n))
        return msg

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class ProcessPool:
    """``size`` worker processes (started lazily); ``await call(fn, *args, timeout=...)``.

    ``fn`` must be picklable (a module-level function). ``preload`` modules are
    imported once per worker at start, outside any call's deadline.
    """

    def __init__(self, size: int = 1, *, preload: tuple[str, ...] = (), startup_timeout_s: float = 120.0) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.preload = preload
        self.startup_timeout_s = startup_timeout_s
        self._idle: asyncio.Queue[_Worker | None] | None = None
        self._all: set[_Worker] = set()
        self.restarts = 0

    def _queue(self) -> asyncio.Queue[_Worker | None]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.size):
                self._idle.put_nowait(None)
        return self._idle

    async def _start(self) -> _Worker:
        w = await _Worker.start(self.preload)
        self._all.add(w)
        try:
            async with asyncio.timeout(self.startup_timeout_s):
                await w.recv()
        except BaseException:
            self._all.discard(w)
            w.kill()
            raise
        return w

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """Run ``fn(*args)`` in a worker; TimeoutError (worker killed) after ``timeout`` seconds."""
        queue = self._queue()
        worker = await queue.get()
        healthy = False
        try:
            if worker is None or not worker.alive():
                worker = await self._start()
            async with asyncio.timeout(timeout):
                await worker.send((fn, args))
                kind, value = await worker.recv()
            healthy = True
        finally:
            if healthy:
                queue.put_nowait(worker)
            else:
                if worker is not None:
                    self._all.discard(worker)
                    worker.kill()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(worker.proc.wait(), 10)
                    self.restarts += 1
                queue.put_nowait(None)
        if kind == "error":
            raise WorkerError(value)
        return value

    async def close(self) -> None:
        """Kill every worker and reap it (in the loop that started it)."""
        workers = list(self._all)
        self._all.clear()
        self._idle = None
        for w in workers:
            w.kill()
        for w in workers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.proc.wait(), 10)


if __name__ == "__main__":
    _serve()
