"""The sandbox contract: one request/response shape for every backend.

The shape follows SandboxFusion's ``/run_code`` (code or argv, language, files
in, stdin, limits -> status, exit code, capped stdout/stderr, timings, files
out) so that a peer speaking SandboxFusion can talk to any of our backends and
we can talk to a SandboxFusion service.

Every backend is async and safe to call from many episodes at once: the
:class:`ConcurrencyLimiter` caps how many executions a backend runs at a time
and queues the rest (bounded, with a deadline), so a burst of rollouts waits
instead of overloading a daemon.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Status = Literal["ok", "error", "timeout", "oom", "output_limit", "sandbox_error"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "oom", "output_limit", "sandbox_error")
Language = Literal["python", "bash"]

#: The file a request's ``code`` is written to, per language (inside the work dir).
MAIN_FILE: dict[str, str] = {"python": "main.py", "bash": "main.sh"}


class ExecRequest(BaseModel):
    """What to run and under which limits.

    Give ``code`` (run as ``main.py`` / ``main.sh`` in the work dir) or ``argv``
    (a command run in the work dir; ``code``, if also given, is still written
    to the main file). ``files`` are written into the work dir first
    (str = text, bytes = binary); ``fetch_files`` names work-dir files to
    return. ``cpu_time_s`` defaults to the wall timeout.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str | None = None
    argv: list[str] | None = None
    language: Language = "python"
    files: dict[str, str | bytes] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    stdin: str | bytes = ""
    wall_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    cpu_time_s: float | None = Field(default=None, gt=0, le=3600)
    memory_mb: int = Field(default=512, ge=16, le=1 << 20)
    max_processes: int = Field(default=64, ge=1, le=100_000)
    max_output_bytes: int = Field(default=1 << 20, ge=0, le=1 << 30)
    max_file_bytes: int = Field(default=64 << 20, ge=0, le=1 << 40)
    network: bool = False

    @model_validator(mode="after")
    def _code_or_argv(self) -> Self:
        if self.code is None and not self.argv:
            raise ValueError("ExecRequest needs `code` or a non-empty `argv`")
        return self

    @field_validator("files", "fetch_files")
    @classmethod
    def _relative_paths(cls, v: Any) -> Any:
        for name in v:
            if not name or name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"file name {name!r} must be a relative path inside the work dir")
        return v

    @property
    def cpu_limit_s(self) -> float:
        return self.cpu_time_s if self.cpu_time_s is not None else self.wall_timeout_s

    def main_file(self) -> str:
        return MAIN_FILE[self.language]

    def command(self) -> list[str]:
        """The argv to run (relative to the work dir) for an exec-based backend."""
        if self.argv:
            return list(self.argv)
        if self.language == "python":
            return ["python3", "-E", "-s", self.main_file()]  # not -I: the work dir must be importable
        return ["bash", self.main_file()]

    def all_files(self) -> dict[str, bytes]:
        """Input files plus the main file, as bytes."""
        out = {k: v.encode() if isinstance(v, str) else v for k, v in self.files.items()}
        if self.code is not None:
            out[self.main_file()] = self.code.encode()
        return out

    def stdin_bytes(self) -> bytes:
        return self.stdin.encode() if isinstance(self.stdin, str) else self.stdin

    @classmethod
    def from_sandboxfusion(cls, body: Mapping[str, Any]) -> ExecRequest:
        """Parse a SandboxFusion ``/run_code`` body (files are base64)."""
        allowed = {"code", "language", "run_timeout", "compile_timeout", "memory_limit_MB", "stdin",
                   "files", "fetch_files"}
        unknown = set(body) - allowed
        if unknown:
            raise ValueError(f"unknown /run_code keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        files: dict[str, str | bytes] = {k: base64.b64decode(v) for k, v in (body.get("files") or {}).items()}
        return cls(
            code=body["code"],
            language=body.get("language", "python"),
            wall_timeout_s=float(body.get("run_timeout") or 10.0),
            memory_mb=int(body.get("memory_limit_MB") or 512),
            stdin=body.get("stdin") or "",
            files=files,
            fetch_files=list(body.get("fetch_files") or []),
        )


class ExecResult(BaseModel):
    """What happened. ``stdout``/``stderr`` are decoded (UTF-8, replace) and capped."""

    model_config = ConfigDict(extra="forbid")

    status: Status
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    files: dict[str, bytes] = Field(default_factory=dict)
    #: Why the sandbox itself failed, or which limit was hit; empty when ok.
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_sandboxfusion(self) -> dict[str, Any]:
        """The SandboxFusion ``/run_code`` response shape."""
        run_status = {"ok": "Finished", "error": "Finished", "timeout": "TimeLimitExceeded",
                      "oom": "Finished", "output_limit": "Finished", "sandbox_error": "Error"}[self.status]
        return {
            "status": "Success" if self.status == "ok" else ("SandboxError" if self.status == "sandbox_error"
                                                             else "Failed"),
            "message": self.message,
            "compile_result": None,
            "run_result": {
                "status": run_status,
                "execution_time": self.wall_s,
                "return_code": self.exit_code,
                "stdout": self.stdout,
                "stderr": self.stderr,
            },
            "executor_pod_name": None,
            "files": {k: base64.b64encode(v).decode() for k, v in self.files.items()},
            "agentrl_status": self.status,
        }


def sandbox_error(message: str, *, wall_s: float = 0.0) -> ExecResult:
    return ExecResult(status="sandbox_error", message=message, wall_s=wall_s)


def decode_capped(data: bytes, limit: int) -> tuple[str, bool]:
    """Decode at most ``limit`` bytes; report whether anything was cut."""
    truncated = len(data) > limit
    return data[:limit].decode("utf-8", "replace"), truncated


@runtime_checkable
class Sandbox(Protocol):
    """An execution backend. Never raises for bad code: failures are statuses."""

    async def run(self, request: ExecRequest) -> ExecResult: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...


class QueueFull(Exception):
    """Raised by :class:`ConcurrencyLimiter` when its wait queue is full."""


class ConcurrencyLimiter:
    """At most ``max_concurrency`` holders at once; at most ``max_queue`` waiting.

    Waiting is bounded in time too (``queue_timeout_s``): a caller that cannot
    start in time gets :class:`TimeoutError`, never an unbounded wait.
    """

    def __init__(self, max_concurrency: int, max_queue: int = 10_000, queue_timeout_s: float = 600.0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._sem = asyncio.Semaphore(max_concurrency)
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self.running = 0

    async def __aenter__(self) -> None:
        if self._sem.locked() and self.waiting >= self.max_queue:
            raise QueueFull(f"sandbox queue full ({self.max_queue} waiting)")
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    async def __aexit__(self, *exc: object) -> None:
        self.running -= 1
        self._sem.release()


class QueueConfig(BaseModel):
    """How requests wait for a free slot (a container, worker, sandbox or connection); every backend's
    config has these keys."""

    model_config = ConfigDict(extra="forbid")

    max_queue: int = Field(
        default=10_000,
        ge=0,
        description="requests that may wait for a free slot; more fail with sandbox_error (0: none)",
    )
    queue_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds a request may wait for a free slot before it fails with sandbox_error",
    )


class LimitConfig(QueueConfig):
    """Concurrency/queue settings of the limiter every backend runs requests through."""

    max_concurrency: int = Field(default=4, ge=1, description="requests run at once (the rest wait)")


class BaseSandbox:
    """Shared plumbing: the limiter, exception-to-status mapping, context manager.

    Subclasses implement :meth:`_execute` (and :meth:`close`); :meth:`run`
    never raises for anything the request or the backend does.
    """

    def __init__(self, limits: LimitConfig) -> None:
        self.limiter = ConcurrencyLimiter(limits.max_concurrency, limits.max_queue, limits.queue_timeout_s)
        self.closed = False

    async def run(self, request: ExecRequest) -> ExecResult:
        if self.closed:
            return sandbox_error(f"{type(self).__name__} is closed")
        t0 = time.perf_counter()
        try:
            async with self.limiter:
                return await self._execute(request)
        except QueueFull as e:
            return sandbox_error(str(e))
        except TimeoutError:
            return sandbox_error("timed out waiting for a free sandbox slot", wall_s=time.perf_counter() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a backend bug or an unreachable service: a status, not a crash
            return sandbox_error(f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)

    async def _execute(self, request: ExecRequest) -> ExecResult:
        raise NotImplementedError

    def workspace(self, spec: Any = None, *, prepared: Any = None) -> Any:
        """A persistent workspace (agentrl.sandboxes.workspace); backends that cannot hold one refuse."""
        from .workspace import unsupported

        raise unsupported(type(self).__name__)

    async def prepare(self, spec: Any) -> Any:
        """A task's set-up done once, for copy-on-write forks (``workspace(spec, prepared=...)``)."""
        from .workspace import unsupported

        raise unsupported(type(self).__name__)

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class LimitedSandbox(BaseSandbox):
    """Wraps any :class:`Sandbox` (e.g. a third-party one) with a concurrency limit and a queue."""

    def __init__(self, inner: Sandbox, limits: LimitConfig | None = None) -> None:
        super().__init__(limits or LimitConfig())
        self.inner = inner

    async def _execute(self, request: ExecRequest) -> ExecResult:
        return await self.inner.run(request)

    async def close(self) -> None:
        await super().close()
        await self.inner.close()
