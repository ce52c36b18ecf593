"""The default backend: bubblewrap sandboxes with a warm fork-server pool.

Each pool worker is one ``bwrap`` process with every namespace unshared (user,
pid, net, ipc, uts, mount, cgroup), no network (only ``lo`` exists inside),
read-only ``/usr``, fresh tmpfs ``/work`` and ``/tmp``, a clean environment,
running as uid 65534 (both inside and, when we are root, on the host). Inside
it, :mod:`agentrl.sandboxes._forkserver` is PID 1 and forks one fresh process
per request with rlimits (CPU, address space, file size, processes), then kills
everything the request left and wipes the writable directories. The server is
out of the code's reach (not dumpable, every child under a seccomp filter; see
:class:`agentrl.sandboxes._forkserver.Guard`). Where cgroups are writable, each
worker also gets a memory and a pids cgroup.

The host keeps a wall-clock backstop: a worker that does not answer in time
is killed (its PID namespace dies with its init) and replaced.

``mode: fresh`` runs one new bwrap per request instead (slower; it is what a
request with ``network: true`` gets when ``allow_network`` is set).
Without bubblewrap the backend refuses to start unless ``unsafe_local: true``:
then the same fork server runs directly on the host with rlimits only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from .base import (
    BaseSandbox,
    ExecRequest,
    ExecResult,
    LimitConfig,
    QueueConfig,
    decode_capped,
    sandbox_error,
)
from .local_workspace import SERVER_FILES, LocalPrepared, LocalWorkspace, forget_compiled, prepare_local
from .workspace import PreparedState, WorkspaceSpec, WorkspaceUnsupported

log = logging.getLogger(__name__)
_HDR = struct.Struct(">I")
_FORKSERVER = Path(__file__).with_name("_forkserver.py")
_ids = itertools.count()

#: The writable directories of a sandbox, the work dir first: the fork server empties them after each request.
SCRATCH_DIRS = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


class LocalConfig(QueueConfig):
    """Settings of the ``local`` backend."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["pool", "fresh"] = Field(
        default="pool",
        description="pool: warm fork-server workers, reused; fresh: one new bwrap per request (slower)",
    )
    pool_size: int = Field(
        default=2, ge=1, le=256, description="requests run at once (warm workers in pool mode)"
    )
    max_uses: int = Field(
        default=10_000, ge=1, description="requests a worker serves before it is replaced (bounds slow leaks)"
    )
    unsafe_local: bool = Field(
        default=False,
        description="run code on the host without bubblewrap, with rlimits only (no isolation: dangerous)",
    )
    allow_network: bool = Field(
        default=False,
        description="run requests with network: true (each in a fresh bwrap); false: they get sandbox_error",
    )
    bwrap: str = Field(default="bwrap", description="bubblewrap executable (name on PATH or path)")
    python: str = Field(
        default="/usr/bin/python3",
        description="interpreter of the fork server and Python code (in bwrap: under /usr or in ro_binds)",
    )
    uid: int = Field(default=65534, description="uid of the code inside bwrap (and on the host when run as root)")
    gid: int = Field(default=65534, description="gid of the code inside bwrap (and on the host when run as root)")
    ro_binds: list[str] = Field(
        default_factory=list, description="extra host paths bound read-only at the same place (e.g. a venv)"
    )
    tmpfs_mb: int = Field(
        default=256, ge=1, description="size in MB of each tmpfs in bwrap (/work, /tmp, /dev/shm)"
    )
    cgroups: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: a memory and pids cgroup per worker where writable; off: none (rlimits only)",
    )
    server_overhead_mb: int = Field(
        default=64,
        ge=0,
        description="MB the fork server may use on top of a request's memory_mb (cgroup limit)",
    )
    startup_timeout_s: float = Field(
        default=15.0, gt=0, description="seconds a new worker may take to start before it counts as failed"
    )
    backstop_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds beyond a request's wall_timeout_s before a silent worker is killed",
    )


class Cgroups:
    """A memory + pids cgroup (v1 or v2) for one worker; a no-op where not writable."""

    def __init__(self, name: str | None) -> None:
        self.dirs: dict[str, Path] = {}
        self._values: dict[str, int] = {}
        if name is None:
            return
        root = Path("/sys/fs/cgroup")
        try:
            own = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return
        if (root / "cgroup.controllers").exists():  # v2: one hierarchy
            path = next((ln.split(":", 2)[2] for ln in own if ln.startswith("0::")), "/")
            self._make("v2", root / path.lstrip("/") / name)
            return
        for line in own:
            _, ctrls, path = line.split(":", 2)
            for ctrl in ("memory", "pids"):
                if ctrl in ctrls.split(","):
                    parent = root / ctrl / path.lstrip("/")
                    self._make(ctrl, (parent if parent.is_dir() else root / ctrl) / name)

    def _make(self, key: str, path: Path) -> None:
        _reap_stale(path.parent)
        try:
            path.mkdir()
            self.dirs[key] = path
        except OSError:
            pass

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def set_limits(self, memory_bytes: int, pids: int) -> None:
        """Write limits (only when they change: each write is a syscall)."""
        writes = [  # (hierarchy, file, value)
            ("memory", "memory.limit_in_bytes", memory_bytes),
            ("pids", "pids.max", pids),
            ("v2", "memory.max", memory_bytes),
            ("v2", "pids.max", pids),
        ]
        for key, fname, value in writes:
            d = self.dirs.get(key)
            if d is None or self._values.get(fname) == value:
                continue
            with contextlib.suppress(OSError):  # not allowed here: remembered anyway, never retried
                (d / fname).write_text(str(value))
            self._values[fname] = value

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs.clear()


def _reap_stale(parent: Path) -> None:
    """Remove empty worker cgroups left by dead processes (e.g. a killed run)."""
    with contextlib.suppress(OSError):
        for d in parent.glob("agentrl-sbx-*-*"):
            pid = d.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    d.rmdir()


def _preexec(procs_files: list[str], uid: int | None, gid: int | None) -> Any:
    def run() -> None:
        os.setsid()
        for f in procs_files:
            with contextlib.suppress(OSError), open(f, "w") as fh:
                fh.write(str(os.getpid()))
        if uid is not None and gid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    return run


class Worker:
    """One sandbox process running the fork server; serves one request at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, cgroups: Cgroups, env: dict[str, str],
                 host_dirs: tuple[Path, ...] = ()) -> None:
        self.proc = proc
        self.cgroups = cgroups
        self.env = env  # the environment requests see
        self.host_dirs = host_dirs  # unsafe mode only: its work and scratch dirs on the host
        self.uses = 0
        self.healthy = True

    @classmethod
    async def start(cls, config: LocalConfig, server_path: Path, *, network: bool = False) -> Worker:
        cgroups = Cgroups(f"agentrl-sbx-{os.getpid()}-{next(_ids)}" if config.cgroups == "auto" else None)
        as_root = os.geteuid() == 0
        host_dirs: tuple[Path, ...] = ()
        if config.unsafe_local:
            workdir = Path(tempfile.mkdtemp(prefix="agentrl-unsafe-"))
            scratch = Path(tempfile.mkdtemp(prefix="agentrl-unsafe-tmp-"))
            host_dirs = (workdir, scratch)
            if as_root:
                for p in host_dirs:
                    os.chown(p, config.uid, config.gid)
            argv = [config.python, "-I", "-S", str(server_path), "host", str(workdir), str(scratch)]
            request_env = {**SANDBOX_ENV, "HOME": str(workdir), "TMPDIR": str(scratch)}
        else:
            argv = [config.bwrap, *bwrap_args(config, server_path, network=network),
                    config.python, "-I", "-S", "/.agentrl/forkserver.py", "ns", *SCRATCH_DIRS]
            request_env = SANDBOX_ENV
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": SANDBOX_ENV["PATH"]} if config.unsafe_local else {},
            preexec_fn=_preexec(cgroups.procs_files, config.uid if as_root else None, config.gid if as_root else None),
        )
        worker = cls(proc, cgroups, request_env, host_dirs)
        try:
            async with asyncio.timeout(config.startup_timeout_s):
                hello = await worker._recv()
            if not hello.get("ready"):
                raise RuntimeError(f"unexpected hello {hello!r}")
        except Exception as e:
            err = b""
            with contextlib.suppress(Exception):
                worker.kill()
                assert proc.stderr is not None
                err = await asyncio.wait_for(proc.stderr.read(4000), 2)
            await worker.close()
            raise RuntimeError(f"sandbox worker failed to start ({type(e).__name__}: {e}): {err.decode(errors='replace')}") from e
        return worker

    async def _recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        n = _HDR.unpack(await self.proc.stdout.readexactly(4))[0]
        result: dict[str, Any] = json.loads(await self.proc.stdout.readexactly(n))
        return result

    async def execute(self, request: ExecRequest, config: LocalConfig) -> ExecResult:
        """Send one request; the caller must hold this worker exclusively."""
        self.uses += 1
        t0 = time.perf_counter()
        nproc = request.max_processes + 4
        self.cgroups.set_limits((request.memory_mb + config.server_overhead_mb) << 20, nproc)
        nproc_rlimit = 0 if config.unsafe_local else request.max_processes + 8 * config.pool_size + 16
        data = server_message(request, self.env, nproc_rlimit)
        assert self.proc.stdin is not None
        try:
            async with asyncio.timeout(request.wall_timeout_s + config.backstop_s):
                self.proc.stdin.write(data)
                await self.proc.stdin.drain()
                res = await self._recv()
        except TimeoutError:
            self.healthy = False
            self.kill()
            return ExecResult(status="timeout", wall_s=time.perf_counter() - t0,
                              message="worker did not answer in time; killed and replaced")
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as e:
            self.healthy = False
            self.kill()
            return sandbox_error(f"sandbox worker died: {type(e).__name__}", wall_s=time.perf_counter() - t0)
        if "dirty" in res or res.get("status") == "sandbox_error":
            self.healthy = False
        return server_result(res, request, time.perf_counter() - t0)

    def kill(self) -> None:
        """Kill the worker; its PID namespace (everything in it) dies with it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the chain's leader heads its own group; Popen.kill would poll and
            # reap it under asyncio's child watcher ("Unknown child process", returncode 255)

    async def close(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                with contextlib.suppress(Exception):
                    self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 2.0)
            self.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5.0)
        self.cgroups.remove()
        for d in self.host_dirs:
            shutil.rmtree(d, ignore_errors=True)


def server_message(request: ExecRequest, env: dict[str, str], nproc_rlimit: int) -> bytes:
    """One framed request for the fork server.

    ``nproc_rlimit`` (0 = none): RLIMIT_NPROC counts per host uid, shared by all
    workers, so it is only a loose cap; the pids cgroup and the PID namespace
    are what really hold a fork bomb.
    """
    msg = {
        "files": {k: base64.b64encode(v).decode() for k, v in request.all_files().items()},
        "fetch_files": request.fetch_files,
        "stdin": base64.b64encode(request.stdin_bytes()).decode(),
        "wall": request.wall_timeout_s,
        "cpu": request.cpu_limit_s,
        "mem": request.memory_mb << 20,
        "nproc": nproc_rlimit,
        "max_out": request.max_output_bytes,
        "max_file": request.max_file_bytes,
        "env": env,
        "argv": request.argv or None,
        "language": request.language,
        "main": request.main_file(),
    }
    data = json.dumps(msg).encode()
    return _HDR.pack(len(data)) + data


def server_result(res: dict[str, Any], request: ExecRequest, wall_s: float) -> ExecResult:
    """Turn a fork-server reply into an :class:`ExecResult`."""
    if res.get("status") == "sandbox_error" or "stdout" not in res:
        return sandbox_error(res.get("message", "") or res.get("dirty", "") or "fork server failed", wall_s=wall_s)
    stdout, out_cut = decode_capped(base64.b64decode(res["stdout"]), request.max_output_bytes)
    stderr, err_cut = decode_capped(base64.b64decode(res["stderr"]), request.max_output_bytes)
    status = res["status"]
    message = {"timeout": "wall or CPU time limit exceeded", "oom": "memory limit exceeded",
               "output_limit": f"output exceeded {request.max_output_bytes} bytes"}.get(status, "")
    if res.get("signal"):
        message = (message + f" (killed by signal {res['signal']})").strip()
    return ExecResult(
        status=status,
        exit_code=res["exit_code"],
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=res["stdout_truncated"] or out_cut,
        stderr_truncated=res["stderr_truncated"] or err_cut,
        wall_s=res["wall"],
        cpu_s=res["cpu"],
        files={k: base64.b64decode(v) for k, v in res["files"].items()},
        message=message,
    )


def bwrap_args(config: LocalConfig, server_path: Path, *, network: bool = False) -> list[str]:
    """The bubblewrap command line of one worker (everything unshared, ro system dirs)."""
    args = [
        "--unshare-all", *(["--share-net"] if network else []),
        "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv",
        "--uid", str(config.uid), "--gid", str(config.gid), "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
        "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
        "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(config.tmpfs_mb << 20), "--tmpfs", "/tmp",
        "--size", str(config.tmpfs_mb << 20), "--tmpfs", "/work",
        "--size", str(config.tmpfs_mb << 20), "--tmpfs", "/dev/shm",
        "--mqueue", "/dev/mqueue",  # POSIX message queues become files the server can sweep
        "--remount-ro", "/dev",  # the device nodes stay usable; nothing new can be left in /dev
        "--ro-bind", str(server_path), "/.agentrl/forkserver.py",
        "--remount-ro", "/",
    ]
    if network:
        args += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf",
                 "--ro-bind-try", "/etc/hosts", "/etc/hosts"]
    for path in config.ro_binds:
        args += ["--ro-bind", path, path]
    return [*args, "--chdir", "/work"]


class LocalSandbox(BaseSandbox):
    """Bubblewrap sandboxes with a warm fork-server pool (the default; no daemon).

    See the module docstring. Use as an async context manager (starts the pool).
    """

    Config = LocalConfig

    def __init__(self, config: LocalConfig | None = None) -> None:
        self.config = config or LocalConfig()
        super().__init__(LimitConfig(max_concurrency=self.config.pool_size, max_queue=self.config.max_queue,
                                     queue_timeout_s=self.config.queue_timeout_s))
        if self.config.unsafe_local:
            log.warning(
                "UNSAFE LOCAL SANDBOX: running model-written code WITHOUT bubblewrap isolation "
                "(rlimits only; it can read your files, use the network and signal your processes). "
                "Never use unsafe_local: true on a machine you care about."
            )
        elif shutil.which(self.config.bwrap) is None:
            raise RuntimeError(
                f"the local sandbox needs bubblewrap ({self.config.bwrap!r} not found on PATH): "
                "install it (`apt-get install bubblewrap`), use another backend (docker, e2b, sandboxfusion), "
                "or set `unsafe_local: true` to run code without isolation (dangerous)"
            )
        # A private, world-readable copy of the server: uid 65534 must be able to read it.
        self._dir = Path(tempfile.mkdtemp(prefix="agentrl-sbx-"))
        self._dir.chmod(0o755)
        self._server = self._dir / "forkserver.py"
        shutil.copyfile(_FORKSERVER, self._server)
        self._server.chmod(0o644)
        for name in SERVER_FILES:  # the workspace server imports the fork server's guard
            shutil.copyfile(Path(__file__).with_name(name), self._dir / name)
            (self._dir / name).chmod(0o644)
        self._idle: asyncio.Queue[Worker | None] = asyncio.Queue()
        for _ in range(self.config.pool_size if self.config.mode == "pool" else 0):
            self._idle.put_nowait(None)
        self._live: set[Worker] = set()
        self._closing: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: LocalConfig | dict[str, Any] | None = None) -> LocalSandbox:
        return cls(config if isinstance(config, LocalConfig) else LocalConfig(**(config or {})))

    async def start(self) -> None:
        """Start every pool worker now instead of on first use."""
        slots = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
        kept = [w for w in slots if w is not None]
        started = await asyncio.gather(*(Worker.start(self.config, self._server) for w in slots if w is None),
                                       return_exceptions=True)
        for w in [*kept, *started]:
            self._idle.put_nowait(w if isinstance(w, Worker) else None)
            if isinstance(w, Worker):
                self._live.add(w)
        errors = [w for w in started if isinstance(w, BaseException)]
        if errors:
            raise RuntimeError(f"could not start the sandbox pool: {errors[0]}") from errors[0]

    async def __aenter__(self) -> LocalSandbox:
        await self.start()
        return self

    def workers(self) -> list[Worker]:
        """Live workers (for health checks and tests)."""
        return [w for w in self._live if w.proc.returncode is None]

    async def _run_fresh(self, request: ExecRequest) -> ExecResult:
        fresh = await Worker.start(self.config, self._server, network=request.network)
        try:
            return await fresh.execute(request, self.config)
        finally:
            await fresh.close()

    async def _execute(self, request: ExecRequest) -> ExecResult:
        if request.network and not self.config.allow_network:
            return sandbox_error("network access was requested but this local sandbox has allow_network: false")
        if self.config.mode == "fresh" or request.network:
            return await self._run_fresh(request)
        async with asyncio.timeout(self.config.queue_timeout_s):
            slot = await self._idle.get()
        worker: Worker | None = slot
        try:
            if worker is None or worker.proc.returncode is not None:
                worker = await Worker.start(self.config, self._server)
                self._live.add(worker)
            result = await worker.execute(request, self.config)
        except BaseException:
            if worker is not None:
                worker.healthy = False
            raise
        finally:
            if worker is not None:
                if worker.healthy and worker.uses < self.config.max_uses and worker.proc.returncode is None:
                    self._idle.put_nowait(worker)
                else:
                    self._idle.put_nowait(None)
                    self._live.discard(worker)
                    worker.kill()
                    task = asyncio.get_running_loop().create_task(worker.close())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
            else:
                self._idle.put_nowait(None)
        return result

    def workspace(self, spec: WorkspaceSpec | None = None, *, prepared: PreparedState | None = None) -> LocalWorkspace:
        """One persistent workspace in its own bwrap (``async with``); see agentrl.sandboxes.local_workspace."""
        if self.config.unsafe_local:
            raise WorkspaceUnsupported("workspaces need bubblewrap: the local sandbox has unsafe_local: true")
        return LocalWorkspace(self.config, self._dir, spec or WorkspaceSpec(), prepared)

    async def prepare(self, spec: WorkspaceSpec) -> LocalPrepared:
        """Run ``spec``'s set-up once; ``workspace(spec, prepared=...)`` forks it (overlayfs, copy-on-write)."""
        if self.config.unsafe_local:
            raise WorkspaceUnsupported("workspaces need bubblewrap: the local sandbox has unsafe_local: true")
        return await prepare_local(self.config, self._dir, spec)

    async def close(self) -> None:
        await super().close()
        workers = list(self._live)
        self._live.clear()
        await asyncio.gather(*(w.close() for w in workers), *self._closing, return_exceptions=True)
        forget_compiled(self._dir)
        shutil.rmtree(self._dir, ignore_errors=True)
