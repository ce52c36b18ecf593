"""Fixtures for the sandbox tests: local stand-ins for e2b and SandboxFusion, docker discovery.

- ``e2b_server``: an aiohttp server speaking the e2b code-interpreter protocol
  (``POST /execute`` -> NDJSON ``stdout``/``stderr``/``error``/
  ``number_of_executions`` lines), so the real ``e2b_code_interpreter`` SDK
  runs against it in debug mode. It executes cells in a bubblewrap sandbox.
- ``sandboxfusion_server``: an aiohttp server with SandboxFusion's documented
  ``POST /run_code`` schema, also executing in a bubblewrap sandbox.
- ``docker_reason``: None when a daemon answers and the default image exists,
  else why docker tests skip. ``DOCKER_HOST`` is taken from the environment, or
  from ``/run/agentrl/docker.env`` written by ``.ci/setup_sandboxes.sh``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from agentrl.sandboxes.base import ExecRequest
from agentrl.sandboxes.docker import setup_docker_host


def docker_skip_reason() -> str | None:
    """Why docker tests cannot run here, or None."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed"
    host = setup_docker_host()
    try:
        client = docker.DockerClient(base_url=host, timeout=10) if host else docker.from_env(timeout=10)
        client.ping()
    except Exception as e:
        return f"no docker daemon answers at {host or 'the default socket'} ({type(e).__name__}); run .ci/setup_sandboxes.sh"
    try:
        client.images.get("agentrl/python:3.11")
    except Exception:
        return "image agentrl/python:3.11 is missing; run `agentrl sandbox build-image`"
    finally:
        client.close()
    return None


@pytest.fixture(scope="session")
def docker_reason() -> str | None:
    return docker_skip_reason()


def bwrap_skip_reason() -> str | None:
    return None if shutil.which("bwrap") else "bubblewrap is not installed (apt-get install bubblewrap)"


class ServerThread:
    """Runs an aiohttp app (built inside its own event loop) on 127.0.0.1 in a daemon thread."""

    def __init__(self, make_app: Callable[[], Any]) -> None:
        self.make_app = make_app
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            runner = web.AppRunner(await self.make_app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as e:
            self.error = e
            self._ready.set()
            raise
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self._ready.wait(60)
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _local_backed_app(routes: Callable[[Any, Any], None]) -> Any:
    from aiohttp import web

    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    app = web.Application(client_max_size=256 << 20)
    state: dict[str, Any] = {}

    async def on_startup(app: Any) -> None:
        state["sandbox"] = await LocalSandbox(LocalConfig(pool_size=2)).__aenter__()

    async def on_cleanup(app: Any) -> None:
        await state["sandbox"].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    routes(app, state)
    return app


def _e2b_routes(app: Any, state: dict[str, Any]) -> None:
    from aiohttp import web

    counter = {"n": 0}

    async def execute(request: Any) -> Any:
        body = await request.json()
        language = body.get("language") or "python"
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        result = await state["sandbox"].run(ExecRequest(
            code=body["code"], language=language if language in ("python", "bash") else "python",
            wall_timeout_s=120, memory_mb=4096, max_output_bytes=256 << 20, max_processes=256))
        counter["n"] += 1
        now = time.time()
        lines: list[dict[str, Any]] = []
        if result.stdout:
            lines.append({"type": "stdout", "text": result.stdout, "timestamp": now})
        if result.stderr:
            lines.append({"type": "stderr", "text": result.stderr, "timestamp": now})
        if result.status != "ok":
            tail = result.stderr.strip().splitlines()[-1:] or [result.status]
            name, _, value = tail[0].partition(": ")
            lines.append({"type": "error", "name": name, "value": value, "traceback": result.stderr})
        lines.append({"type": "number_of_executions", "execution_count": counter["n"]})
        for line in lines:
            await resp.write((json.dumps(line) + "\n").encode())
        await resp.write_eof()
        return resp

    app.router.add_post("/execute", execute)


def _sandboxfusion_routes(app: Any, state: dict[str, Any]) -> None:
    from aiohttp import web

    async def run_code(request: Any) -> Any:
        try:
            req = ExecRequest.from_sandboxfusion(await request.json())
        except Exception as e:
            return web.json_response({"detail": str(e)}, status=422)
        result = await state["sandbox"].run(req)
        return web.json_response(result.to_sandboxfusion())

    app.router.add_post("/run_code", run_code)


@pytest.fixture(scope="session")
def e2b_server() -> Iterator[ServerThread]:
    if bwrap_skip_reason():
        pytest.skip(bwrap_skip_reason() or "")
    with ServerThread(lambda: _local_backed_app(_e2b_routes)) as server:
        yield server


@pytest.fixture(scope="session")
def sandboxfusion_server() -> Iterator[ServerThread]:
    if bwrap_skip_reason():
        pytest.skip(bwrap_skip_reason() or "")
    with ServerThread(lambda: _local_backed_app(_sandboxfusion_routes)) as server:
        yield server


@contextlib.asynccontextmanager
async def open_backend(name: str, request: pytest.FixtureRequest, *, pool_size: int = 2) -> AsyncIterator[Any]:
    """A started backend of kind ``name`` with ``pool_size`` warm workers (skips when it cannot run here)."""
    if name == "local":
        if bwrap_skip_reason():
            pytest.skip(bwrap_skip_reason() or "")
        from agentrl.sandboxes.local import LocalConfig, LocalSandbox

        sb: Any = LocalSandbox(LocalConfig(pool_size=pool_size))
    elif name in ("docker", "docker-server"):
        reason = request.getfixturevalue("docker_reason")
        if reason:
            pytest.skip(reason)
        from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

        sb = DockerSandbox(DockerConfig(pool_size=pool_size, mode="server" if name == "docker-server" else "exec"))
    elif name == "e2b":
        from agentrl.sandboxes.e2b import E2BConfig, E2BSandbox

        server = request.getfixturevalue("e2b_server")
        sb = E2BSandbox(E2BConfig(debug=True, sandbox_url=server.url, pool_size=pool_size))
    elif name == "sandboxfusion":
        from agentrl.sandboxes.sandboxfusion import SandboxFusionConfig, SandboxFusionSandbox

        server = request.getfixturevalue("sandboxfusion_server")
        sb = SandboxFusionSandbox(SandboxFusionConfig(url=server.url, max_concurrency=4))
    else:
        raise ValueError(name)
    async with sb:
        yield sb


def nobody_processes() -> dict[int, str]:
    """Host processes running as uid 65534 (every sandboxed process here), pid -> cmdline."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != 65534:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                out[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return out


def processes_matching(marker: str) -> list[str]:
    """Cmdlines of host processes (any user) containing ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(cmd)
    return found


class ProcTools:
    """Host process inspection helpers, handed to tests as a fixture."""

    nobody = staticmethod(nobody_processes)
    matching = staticmethod(processes_matching)

    @staticmethod
    async def settle(baseline: int, timeout_s: float = 15.0) -> dict[int, str]:
        """Wait (bounded) until no more uid-65534 processes exist than ``baseline``; return them."""
        deadline = time.monotonic() + timeout_s
        while True:
            procs = nobody_processes()
            if len(procs) <= baseline or time.monotonic() > deadline:
                return procs
            await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
def proc_tools() -> type[ProcTools]:
    return ProcTools


@pytest.fixture(scope="session")
def backend_opener() -> Callable[..., Any]:
    """``async with backend_opener(name, request[, pool_size=N]) as sb``: a started backend, or a skip."""
    return open_backend
