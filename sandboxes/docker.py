"""``docker`` backend: a warm pool of locked-down containers (Python Docker SDK).

Each container: network disabled, memory/pids/CPU limits, read-only root,
tmpfs ``/work`` and ``/tmp``, all capabilities dropped, ``no-new-privileges``,
uid 65534. Two modes:

- ``exec`` (default): docker's init is PID 1 and ``sleep infinity`` keeps the
  container up; a request is one ``docker exec`` of ``timeout -s KILL`` around
  the same fork server the local backend uses (mode ``tree``): it writes the
  files, runs the code with rlimits, caps output, then kills everything the
  request left and wipes ``/work`` and ``/tmp``. The request travels on the
  exec's stdin (``docker cp`` cannot write into a tmpfs).
- ``server``: the fork server is the container's PID 1 (mode ``ns``, exactly
  as in the local backend), warm, fed through the container's attach stream:
  ~50x faster, and the code cannot signal its supervisor. The wall timeout is
  the server's own; the host backstop removes a container that stops answering.

A container is replaced after a timeout, an OOM, a sandbox error or
``max_uses`` requests.

Images are never pulled: build the default one with ``agentrl sandbox build-image``.
The SDK is synchronous; every call runs in a worker thread under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import struct
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
    sandbox_error,
)
from .docker_workspace import DockerPrepared, DockerWorkspace, prepare_docker
from .local import SANDBOX_ENV, SCRATCH_DIRS, server_message, server_result
from .workspace import PreparedState, WorkspaceSpec

_SERVER_SRC = Path(__file__).with_name("_forkserver.py").read_text()
_HDR = struct.Struct(">I")
_ids = itertools.count()


class DockerConfig(QueueConfig):
    """Settings of the ``docker`` backend."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(
        default="agentrl/python:3.11",
        description="local image (never pulled; build it with `agentrl sandbox build-image`)",
    )
    base_url: str | None = Field(
        default=None, description="docker daemon address; default: $DOCKER_HOST, else the standard socket"
    )
    pool_size: int = Field(
        default=2, ge=1, le=256, description="containers in the pool, i.e. requests run at once"
    )
    max_uses: int = Field(default=200, ge=1, description="requests a container serves before it is replaced")
    #: Container-wide limits (a request's own memory/CPU/process limits apply inside them).
    memory_mb: int = Field(default=1024, ge=64, description="memory limit of each container in MB (no swap)")
    pids_limit: int = Field(default=256, ge=8, description="max processes and threads in each container")
    cpus: float = Field(default=1.0, gt=0, description="CPU cores each container may use (fractions allowed)")
    tmpfs_mb: int = Field(
        default=256, ge=1, description="size in MB of each container's /work and /tmp tmpfs"
    )
    user: str = Field(default="65534:65534", description="uid:gid the containers and their execs run as")
    python: str = Field(
        default="python3", description="interpreter in the image that runs the fork server and Python code"
    )
    api_timeout_s: float = Field(default=60.0, gt=0, description="seconds allowed for each docker API call")
    backstop_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds beyond a request's wall_timeout_s before its container is replaced",
    )
    label: str = Field(
        default="org.agentrl.sandbox",
        description="label key marking our containers (leftovers of dead runs are removed)",
    )
    #: ``exec``: one ``docker exec timeout -s KILL ... fork-server`` per request (containers idle on
    #: ``sleep``). ``server``: the fork server is each container's PID 1, kept warm and fed through
    #: the attach stream (much faster; the code cannot signal its supervisor; the wall timeout is
    #: the server's own, with the host backstop killing the container).
    workspace_user: str = Field(
        default="0:0",
        description="uid:gid of workspace containers and their commands (root with a few capabilities: "
        "task images expect to own their files)",
    )
    mode: Literal["exec", "server"] = Field(
        default="exec",
        description="exec: one docker exec per request; server: a warm fork server per container (faster)",
    )


class _Stream:
    """The attach stream of a ``server``-mode container: our frames in, docker-multiplexed frames out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: Any) -> None:
        self.reader, self.writer, self._keep = reader, writer, keep  # keep: the SDK's socket object
        self.buf = bytearray()

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            header = await self.reader.readexactly(8)
            data = await self.reader.readexactly(struct.unpack(">I", header[4:])[0])
            if header[0] == 1:  # stdout; stderr frames are dropped
                self.buf += data
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def recv(self) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(await self.read(_HDR.unpack(await self.read(4))[0]))
        return reply

    async def request(self, payload: bytes) -> dict[str, Any]:
        self.writer.write(payload)
        await self.writer.drain()
        return await self.recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class SupervisorKilled(Exception):
    """The in-container fork server died of SIGKILL before answering."""


SETUP_ENV_FILE = Path("/run/agentrl/docker.env")
"""Where .ci/setup_sandboxes.sh writes `export DOCKER_HOST=...` for the dockerd it starts."""


def setup_docker_host(env_file: Path = SETUP_ENV_FILE) -> str | None:
    """DOCKER_HOST, else the one the set-up script wrote (then also put into the environment), else None."""
    if os.environ.get("DOCKER_HOST"):
        return os.environ["DOCKER_HOST"]
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            if "DOCKER_HOST=" in line:
                os.environ["DOCKER_HOST"] = line.split("DOCKER_HOST=", 1)[1].strip().strip("'\"")
                return os.environ["DOCKER_HOST"]
    return None


def exec_with_stdin(
    api: Any, container_id: str, argv: list[str], payload: bytes, deadline_s: float, *, user: str, workdir: str
) -> tuple[str, bytes, bytes]:
    """Run `argv` in the container with `payload` on its stdin; (exec id, stdout, stderr) once it closes them.

    The docker SDK's `exec_run` has no timeout: the raw socket gets `deadline_s` for every read.
    """
    exec_id: str = api.exec_create(container_id, argv, stdin=True, stdout=True, stderr=True,
                                   user=user, workdir=workdir, environment={})["Id"]  # fmt: skip
    sock = api.exec_start(exec_id, socket=True)
    raw: socket.socket = getattr(sock, "_sock", sock)
    try:
        raw.settimeout(deadline_s)
        raw.sendall(payload)
        raw.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            b = raw.recv(1 << 16)
            if not b:
                break
            chunks.append(b)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    out, err = _demux(b"".join(chunks))
    return exec_id, out, err


def _demux(data: bytes) -> tuple[bytes, bytes]:
    """Split docker's multiplexed attach stream (8-byte frame headers) into stdout/stderr."""
    out, err, i = bytearray(), bytearray(), 0
    while i + 8 <= len(data):
        kind, size = data[i], struct.unpack(">I", data[i + 4:i + 8])[0]
        (out if kind == 1 else err).extend(data[i + 8:i + 8 + size])
        i += 8 + size
    return bytes(out), bytes(err)


class DockerSandbox(BaseSandbox):
    """A warm pool of locked-down Docker containers (images are never pulled).

    See the module docstring. Use as an async context manager (starts the pool).
    """

    Config = DockerConfig

    def __init__(self, config: DockerConfig | None = None) -> None:
        self.config = config or DockerConfig()
        super().__init__(LimitConfig(max_concurrency=self.config.pool_size, max_queue=self.config.max_queue,
                                     queue_timeout_s=self.config.queue_timeout_s))
        import docker  # lazy: only this backend needs the SDK

        kwargs: dict[str, Any] = {"timeout": int(self.config.api_timeout_s)}
        base_url = self.config.base_url or os.environ.get("DOCKER_HOST")
        self.client = docker.DockerClient(base_url=base_url, **kwargs) if base_url else docker.from_env(**kwargs)
        self._idle: asyncio.Queue[Any | None] = asyncio.Queue()
        for _ in range(self.config.pool_size):
            self._idle.put_nowait(None)
        self._uses: dict[str, int] = {}
        self._all: dict[str, Any] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._streams: dict[str, _Stream] = {}
        self._owner = self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._reaped = False
        self._ws_reaped = False

    @classmethod
    def from_config(cls, config: DockerConfig | dict[str, Any] | None = None) -> DockerSandbox:
        return cls(config if isinstance(config, DockerConfig) else DockerConfig(**(config or {})))

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async with asyncio.timeout(self.config.api_timeout_s):
            return await asyncio.to_thread(fn, *args, **kwargs)

    def _reap_stale_sync(self) -> None:
        """Remove containers left by dead processes of this host (e.g. a killed run)."""
        host = socket.gethostname()
        for container in self.client.containers.list(all=True, filters={"label": self.config.label}):
            owner_host, _, pid = container.labels.get(self.config.label, "").rpartition(":")
            if owner_host == host and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(Exception):
                    container.remove(force=True)

    def reap_stale_workspaces_sync(self) -> None:
        """Once per backend: remove containers and prepared images left by dead processes of this host."""
        if self._ws_reaped:
            return
        self._ws_reaped = True
        host = socket.gethostname()
        with contextlib.suppress(Exception):
            self._reap_stale_sync()
            for image in self.client.images.list(filters={"label": self.config.label}):
                owner_host, _, pid = (image.labels or {}).get(self.config.label, "").rpartition(":")
                if owner_host == host and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    with contextlib.suppress(Exception):
                        self.client.images.remove(image.id, force=True)

    def workspace(self, spec: WorkspaceSpec | None = None, *, prepared: PreparedState | None = None) -> DockerWorkspace:
        """One persistent workspace in its own container (``async with``); see agentrl.sandboxes.docker_workspace."""
        return DockerWorkspace(self, spec or WorkspaceSpec(), prepared)

    async def prepare(self, spec: WorkspaceSpec) -> DockerPrepared:
        """Run ``spec``'s set-up once and commit it; ``workspace(spec, prepared=...)`` starts from that image."""
        return await prepare_docker(self, spec)

    def _create_sync(self) -> Any:
        c = self.config
        if not self._reaped:
            self._reaped = True
            with contextlib.suppress(Exception):
                self._reap_stale_sync()
        tmpfs_opts = f"rw,nosuid,nodev,size={c.tmpfs_mb}m,uid=65534,gid=65534,mode=1777"
        import docker.errors

        try:
            self.client.images.get(c.image)
        except docker.errors.ImageNotFound:
            raise RuntimeError(
                f"docker image {c.image!r} is not available locally; build it with `agentrl sandbox build-image` "
                "(sandbox images are never pulled)"
            ) from None
        server = c.mode == "server"
        command = ([c.python, "-I", "-S", "-c", _SERVER_SRC, "ns", *SCRATCH_DIRS] if server
                   else ["sleep", "infinity"])
        # containers.create, not containers.run: run() would pull a missing image
        container = self.client.containers.create(
            c.image,
            command,
            name=f"agentrl-sbx-{os.getpid()}-{next(_ids)}-{int(time.time() * 1000) % 100000}",
            init=not server,  # server mode: the fork server itself is PID 1
            stdin_open=server,
            network_disabled=True,
            network_mode="none",
            mem_limit=f"{c.memory_mb}m",
            memswap_limit=f"{c.memory_mb}m",
            pids_limit=c.pids_limit,
            nano_cpus=int(c.cpus * 1e9),
            read_only=True,
            tmpfs={"/work": tmpfs_opts, "/tmp": tmpfs_opts},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user=c.user,
            working_dir="/work",
            environment={},
            labels={c.label: self._owner},
            auto_remove=False,
        )
        try:
            # attach before start, so the server's hello is not missed
            sock = (self.client.api.attach_socket(container.id, params={"stdin": 1, "stdout": 1, "stream": 1})
                    if server else None)
            container.start()
        except Exception:
            container.remove(force=True)
            raise
        return container, sock

    async def _new_container(self) -> Any:
        container, sock = await self._call(self._create_sync)
        self._all[container.id] = container
        self._uses[container.id] = 0
        if sock is not None:
            try:
                reader, writer = await asyncio.open_connection(sock=getattr(sock, "_sock", sock), limit=1 << 20)
                stream = _Stream(reader, writer, sock)
                async with asyncio.timeout(self.config.api_timeout_s):
                    hello = await stream.recv()
                if not hello.get("ready"):
                    raise RuntimeError(f"unexpected hello from the container's fork server: {hello!r}")
            except BaseException:
                self._retire(container)
                raise
            self._streams[container.id] = stream
        return container

    async def start(self) -> None:
        """Create the whole pool now instead of on first use."""
        slots = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
        made = await asyncio.gather(*(self._new_container() for s in slots if s is None), return_exceptions=True)
        kept = [s for s in slots if s is not None]
        for c in [*kept, *made]:
            self._idle.put_nowait(c if not isinstance(c, BaseException) else None)
        errors = [c for c in made if isinstance(c, BaseException)]
        if errors:
            raise RuntimeError(f"could not start the docker sandbox pool: {errors[0]}") from errors[0]

    async def __aenter__(self) -> DockerSandbox:
        await self.start()
        return self

    def _exec_sync(self, container_id: str, argv: list[str], payload: bytes, deadline_s: float) -> tuple[bytes, int]:
        api = self.client.api
        exec_id, out, err = exec_with_stdin(api, container_id, argv, payload, deadline_s,
                                            user=self.config.user, workdir="/work")  # fmt: skip
        code = api.exec_inspect(exec_id).get("ExitCode")
        hello = 4 + _HDR.unpack(out[:4])[0] if len(out) >= 4 else 0
        responded = hello and len(out) >= hello + 4
        if code == 137 and not responded:
            raise SupervisorKilled()
        if code != 0 or not responded:
            raise RuntimeError(f"exec exited {code}: {err[-2000:].decode(errors='replace')}")
        return out, code

    async def _execute(self, request: ExecRequest) -> ExecResult:
        if request.network:
            return sandbox_error("network access was requested but docker sandboxes run with network disabled")
        async with asyncio.timeout(self.config.queue_timeout_s):
            container = await self._idle.get()
        healthy = False
        t0 = time.perf_counter()
        try:
            if container is None:
                container = await self._new_container()
            self._uses[container.id] += 1
            wall = request.wall_timeout_s
            if self.config.mode == "server":
                try:
                    async with asyncio.timeout(wall + self.config.backstop_s):
                        res = await self._streams[container.id].request(server_message(request, SANDBOX_ENV, 0))
                except TimeoutError:
                    return ExecResult(status="timeout", wall_s=time.perf_counter() - t0,
                                      message="container did not answer in time; replaced")
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    return sandbox_error(f"the container's fork server died ({type(e).__name__}); replaced",
                                         wall_s=time.perf_counter() - t0)
                result = server_result(res, request, time.perf_counter() - t0)
                healthy = result.status in ("ok", "error", "output_limit") and "dirty" not in res
                return result
            argv = ["timeout", "-s", "KILL", f"{wall + 2:.3f}",
                    self.config.python, "-I", "-S", "-c", _SERVER_SRC, "tree", *SCRATCH_DIRS]
            env = {**SANDBOX_ENV}
            payload = server_message(request, env, 0)
            try:
                async with asyncio.timeout(wall + self.config.backstop_s):
                    out, _ = await asyncio.to_thread(self._exec_sync, container.id, argv, payload,
                                                     wall + self.config.backstop_s)
            except TimeoutError:
                return ExecResult(status="timeout", wall_s=time.perf_counter() - t0,
                                  message="container did not answer in time; replaced")
            except SupervisorKilled:
                wall_s = time.perf_counter() - t0
                if wall_s >= wall:
                    return ExecResult(status="timeout", wall_s=wall_s, message="killed by `timeout -s KILL`")
                # Before the deadline only the code (or the kernel's OOM killer) kills the supervisor.
                return ExecResult(status="error", exit_code=137, wall_s=wall_s,
                                  message="the sandbox supervisor was killed (did the code signal its parent?); "
                                          "container replaced")
            except Exception as e:
                return sandbox_error(f"docker exec failed: {e}", wall_s=time.perf_counter() - t0)
            hello_len = _HDR.unpack(out[:4])[0]
            rest = out[4 + hello_len:]
            res = json.loads(rest[4:4 + _HDR.unpack(rest[:4])[0]])
            result = server_result(res, request, time.perf_counter() - t0)
            healthy = result.status in ("ok", "error", "output_limit") and "dirty" not in res
            return result
        finally:
            if container is not None and healthy and self._uses[container.id] < self.config.max_uses:
                self._idle.put_nowait(container)
            else:
                self._idle.put_nowait(None)
                if container is not None:
                    self._retire(container)

    def _retire(self, container: Any) -> None:
        stream = self._streams.pop(container.id, None)
        if stream is not None:
            stream.close()
        self._all.pop(container.id, None)
        self._uses.pop(container.id, None)
        task = asyncio.get_running_loop().create_task(self._remove(container))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _remove(self, container: Any) -> None:
        with contextlib.suppress(Exception):
            await self._call(container.remove, force=True)

    async def close(self) -> None:
        await super().close()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        await asyncio.gather(*(self._remove(c) for c in list(self._all.values())), *self._closing,
                             return_exceptions=True)
        self._all.clear()
        with contextlib.suppress(Exception):
            self.client.close()
