"""Workspaces: one isolated, persistent place per episode, for agents that work in a shell.

A one-shot request (:class:`agentrl.sandboxes.base.ExecRequest`) runs one
program and forgets everything. A workspace keeps its files and background
processes between calls until it is closed::

    async with sandbox.workspace(WorkspaceSpec(files={"a.txt": "hi"})) as ws:
        r = await ws.exec("cat a.txt; sleep 100 &", timeout_s=10)   # CommandResult
        await ws.write_file("b.txt", "x")
        data = await ws.read_file("b.txt")                          # bytes

Nothing crosses workspaces; closing one (normally, on an exception, on
cancellation, or, for a killed run, at the next start of a backend) leaves no
process, container, mount or temporary directory behind.

Copy-on-write group start: ``prepared = await sandbox.prepare(spec)`` runs the
spec's set-up (files, ``setup`` commands) once; ``sandbox.workspace(spec,
prepared=prepared)`` then starts a fork of that state that costs no set-up
(an overlayfs layer on ``local``, an image committed from the prepared
container on ``docker``). Close the prepared state when its group is done.

Errors are exceptions carrying an ``error_class`` (agentrl.rollout's failure
classes): a workspace that died or a backend that failed is ``sandbox`` (an
infrastructure failure, retried, never a zero reward); a workspace past its
``lifetime_s`` is ``timeout``; a set-up command that fails is ``env``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from types import TracebackType
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_WORKDIR = "/work"


class WorkspaceError(RuntimeError):
    """The workspace or its backend failed (not the command): an infrastructure failure."""

    error_class = "sandbox"


class WorkspaceUnsupported(WorkspaceError):
    """The backend cannot hold a persistent workspace."""


class WorkspaceExpired(WorkspaceError):
    """The workspace outlived its ``lifetime_s`` and was torn down."""

    error_class = "timeout"


class SetupFailed(WorkspaceError):
    """A set-up command of the spec exited non-zero (the task's fault, not the backend's)."""

    error_class = "env"


class WorkspaceFileError(OSError):
    """``read_file``/``write_file`` refused: outside the workspace, not a regular file, or missing."""


class WorkspaceSpec(BaseModel):
    """What a workspace starts with and the limits it runs under."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: str = Field(default=DEFAULT_WORKDIR, description="absolute path of the work dir (the cwd of every command)")
    writable: tuple[str, ...] = Field(
        default=(), description="more absolute dirs that are writable and kept (e.g. /tests, /logs); /tmp always is"
    )
    files: dict[str, str | bytes] = Field(
        default_factory=dict, description="files written at start (path relative to workdir, or absolute)"
    )
    setup: tuple[str, ...] = Field(default=(), description="shell commands run at start (once, with prepare)")
    setup_timeout_s: float = Field(default=600.0, gt=0, description="limit of each set-up command (seconds)")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables of every command")
    image: str | None = Field(default=None, description="docker: the image (default: the backend's); local: unused")
    network: bool = Field(default=False, description="whether commands may use the network (the backend must allow it)")
    memory_mb: int = Field(default=1024, ge=16, description="memory of the whole workspace (MB)")
    max_processes: int = Field(default=256, ge=4, description="processes and threads of the whole workspace")
    disk_mb: int = Field(default=1024, ge=1, description="size of the writable state (MB; local: a tmpfs; docker: unenforced)")
    lifetime_s: float = Field(default=3600.0, gt=0, description="wall-clock limit of the whole workspace (seconds)")

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or ".." in v.split("/") or v.rstrip("/") in ("", "/proc", "/dev", "/usr"):
            raise ValueError(f"workdir={v!r} must be an absolute path outside /, /usr, /proc, /dev")
        return v.rstrip("/")

    @field_validator("writable")
    @classmethod
    def _absolute_dirs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for d in v:
            if not d.startswith("/") or ".." in d.split("/") or d.rstrip("/") in ("", "/proc", "/dev", "/usr"):
                raise ValueError(f"writable dir {d!r} must be an absolute path outside /, /usr, /proc, /dev")
        return tuple(d.rstrip("/") for d in v)

    def roots(self) -> list[str]:
        """Every writable, kept dir (the work dir first)."""
        return list(dict.fromkeys([self.workdir, *self.writable]))


class CommandResult(BaseModel):
    """What one ``exec`` did. ``exit_code`` is None only when it never ran; -N: killed by signal N."""

    model_config = ConfigDict(extra="forbid")

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def as_text(self, limit: int = 8000) -> str:
        """The result as a tool message: output, then the exit code (and why it stopped)."""
        out = self.stdout + (("\n" if self.stdout and not self.stdout.endswith("\n") else "") + self.stderr
                             if self.stderr else "")
        if len(out) > limit:
            out = out[: limit // 2] + "\n...[output cut]...\n" + out[-limit // 2:]
        tail = f"[exit code {self.exit_code}]"
        if self.timed_out:
            tail = f"[timed out after {self.wall_s:.1f}s; killed]"
        if self.stdout_truncated or self.stderr_truncated:
            tail += " [output truncated]"
        return f"{out.rstrip()}\n{tail}".lstrip("\n")


def command_result(res: dict[str, Any]) -> CommandResult:
    """A workspace server's ``exec`` reply as a :class:`CommandResult`."""
    return CommandResult(
        exit_code=res["exit_code"],
        stdout=base64.b64decode(res["stdout"]).decode("utf-8", "replace"),
        stderr=base64.b64decode(res["stderr"]).decode("utf-8", "replace"),
        stdout_truncated=res["stdout_truncated"],
        stderr_truncated=res["stderr_truncated"],
        timed_out=res["timed_out"],
        wall_s=res["wall"],
    )


class PreparedState:
    """A task's set-up, done once; forks of it start without set-up. Close it when its group is done."""

    def __init__(self, spec: WorkspaceSpec, setup_s: float) -> None:
        self.spec = spec
        self.setup_s = setup_s
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Workspace:
    """One persistent workspace. Backends implement ``_start``, ``_request`` and ``_teardown``.

    Requests are served one at a time (a lock); every await has a deadline.
    """

    #: seconds on top of a command's timeout before the workspace counts as dead
    backstop_s = 10.0
    #: seconds a write/read may take
    file_timeout_s = 60.0

    def __init__(self, spec: WorkspaceSpec, prepared: PreparedState | None = None) -> None:
        if prepared is not None and prepared.closed:
            raise WorkspaceError("the prepared state is closed")
        self.spec = spec
        self.prepared = prepared
        self.closed = False
        self.started = False
        self._lock = asyncio.Lock()
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None
        self.start_s = 0.0

    # -- backend hooks
    async def _start(self) -> None:
        raise NotImplementedError

    async def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        raise NotImplementedError

    async def _teardown(self) -> None:
        raise NotImplementedError

    def _kill_now(self) -> None:
        """Stop everything synchronously (lifetime expiry); ``_teardown`` still runs at close."""

    # -- the contract
    async def start(self) -> Self:
        t0 = time.perf_counter()
        try:
            await self._start()
            self.started = True
            self._timer = asyncio.get_running_loop().call_later(self.spec.lifetime_s, self._expire)
            if self.prepared is None:
                await self.apply_setup()
        except BaseException:
            await self.close()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    async def apply_setup(self) -> None:
        """Write the spec's files and run its set-up commands (a prepared fork already has them)."""
        for path, data in self.spec.files.items():
            await self.write_file(path, data)
        for cmd in self.spec.setup:
            r = await self.exec(cmd, timeout_s=self.spec.setup_timeout_s, max_output_bytes=16384)
            if not r.ok:
                raise SetupFailed(f"set-up command {cmd[:200]!r} failed: {r.as_text(2000)}")

    def _expire(self) -> None:
        self._expired = True
        self._kill_now()

    def _check(self) -> None:
        if self._expired:
            raise WorkspaceExpired(f"the workspace exceeded lifetime_s={self.spec.lifetime_s}")
        if self.closed or not self.started:
            raise WorkspaceError("the workspace is closed" if self.closed else "the workspace was not started")

    async def _call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._check()
        async with asyncio.timeout(timeout_s + self.backstop_s + 5):
            async with self._lock:
                self._check()
                try:
                    res = await self._request(msg, timeout_s)
                except (WorkspaceError, TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError) as e:
                    if self._expired:  # killed by its lifetime while the call ran
                        raise WorkspaceExpired(f"the workspace exceeded lifetime_s={self.spec.lifetime_s}") from e
                    if isinstance(e, WorkspaceError):
                        raise
                    self._kill_now()
                    raise WorkspaceError(f"the workspace died: {type(e).__name__}: {e}") from e
        if res.get("internal"):
            raise WorkspaceError(res["error"])
        return res

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float = 30.0,
        stdin: str | bytes = b"",
        max_output_bytes: int = 64 * 1024,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run ``bash -c cmd`` in the work dir; a command past ``timeout_s`` is killed (its process group)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        msg = {"op": "exec", "cmd": cmd, "stdin": base64.b64encode(data).decode(), "timeout": timeout_s,
               "max_out": max_output_bytes, "cwd": cwd, "env": self.command_env(env)}
        return command_result(await self._call(msg, timeout_s))

    def command_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": self.spec.workdir,
                "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        return {**base, **self.spec.env, **(extra or {})}

    async def write_file(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Write a file (parents made) inside the workspace's writable dirs."""
        raw = data.encode() if isinstance(data, str) else data
        res = await self._call({"op": "write", "path": path, "data": base64.b64encode(raw).decode(), "mode": mode},
                               self.file_timeout_s)
        if "error" in res:
            raise WorkspaceFileError(res["error"])

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        """A regular file inside the workspace's writable dirs (a link resolving outside them is refused)."""
        res = await self._call({"op": "read", "path": path, "max": max_bytes}, self.file_timeout_s)
        if "error" in res:
            raise WorkspaceFileError(res["error"])
        return base64.b64decode(res["data"])

    async def close(self) -> None:
        """Tear down: no process, container, mount or temp dir is left. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._kill_now()
        await self._teardown()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def unsupported(backend: str) -> WorkspaceUnsupported:
    return WorkspaceUnsupported(
        f"the {backend} sandbox cannot hold a persistent workspace (it runs one program per request); "
        "use sandbox name local, docker or e2b for workspaces"
    )
