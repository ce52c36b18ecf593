"""Workspaces on the e2b backend, through the real SDK against a local debug server with persistent state.

The stand-in speaks the code-interpreter wire (`POST /execute` -> NDJSON) like the one-shot tests' server,
but runs every cell in one local *workspace*, as e2b runs cells in one persistent sandbox.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentrl.sandboxes.workspace import WorkspaceError, WorkspaceFileError, WorkspaceSpec

from .conftest import ServerThread, bwrap_skip_reason

pytestmark = pytest.mark.skipif(bwrap_skip_reason() is not None, reason=bwrap_skip_reason() or "")


async def _persistent_app() -> Any:
    from aiohttp import web

    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    app = web.Application(client_max_size=64 << 20)
    state: dict[str, Any] = {"n": 0}

    async def on_startup(app: Any) -> None:
        state["sandbox"] = LocalSandbox(LocalConfig(pool_size=1))
        state["ws"] = await state["sandbox"].workspace(WorkspaceSpec(workdir="/home/user")).start()

    async def on_cleanup(app: Any) -> None:
        await state["ws"].close()
        await state["sandbox"].close()

    async def execute(request: Any) -> Any:
        body = await request.json()
        ws = state["ws"]
        state["n"] += 1
        cell = f"/tmp/cell{state['n']}.py"
        await ws.write_file("/home/user/.cell.py", body["code"])
        r = await ws.exec(f"mv /home/user/.cell.py {cell} && python3 {cell}", timeout_s=60,
                          max_output_bytes=64 << 20)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        lines: list[dict[str, Any]] = []
        if r.stdout:
            lines.append({"type": "stdout", "text": r.stdout, "timestamp": time.time()})
        if r.stderr:
            lines.append({"type": "stderr", "text": r.stderr, "timestamp": time.time()})
        if r.exit_code != 0:
            tail = (r.stderr.strip().splitlines() or ["Error"])[-1]
            name, _, value = tail.partition(": ")
            lines.append({"type": "error", "name": name, "value": value, "traceback": r.stderr})
        lines.append({"type": "number_of_executions", "execution_count": state["n"]})
        for line in lines:
            await resp.write((json.dumps(line) + "\n").encode())
        await resp.write_eof()
        return resp

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/execute", execute)
    return app


@pytest.fixture(scope="module")
def persistent_e2b() -> Iterator[ServerThread]:
    with ServerThread(_persistent_app) as server:
        yield server


async def test_e2b_workspace_persists_and_follows_the_rules(persistent_e2b: ServerThread) -> None:
    from agentrl.sandboxes.e2b import E2BConfig, E2BSandbox

    sb = E2BSandbox(E2BConfig(debug=True, sandbox_url=persistent_e2b.url, pool_size=1))
    try:
        spec = WorkspaceSpec(workdir="/home/user/work", files={"a.txt": "hi\n"}, setup=("echo s > s.txt",))
        async with sb.workspace(spec) as ws:
            r = await ws.exec("cat a.txt s.txt; pwd; sleep 300 & echo $! > bg.pid; exit 2")
            assert (r.exit_code, r.stdout) == (2, "hi\ns\n/home/user/work\n")
            assert (await ws.exec("kill -0 $(cat bg.pid) && echo alive; kill $(cat bg.pid)")).stdout == "alive\n"
            assert (await ws.exec("sleep 20", timeout_s=0.5)).timed_out
            assert (await ws.exec("cat", stdin="in")).stdout == "in"
            await ws.write_file("d/b.txt", "b")
            assert await ws.read_file("/home/user/work/d/b.txt") == b"b"
            await ws.exec("ln -s /etc/hostname out")
            with pytest.raises(WorkspaceFileError):
                await ws.read_file("out")
        with pytest.raises(WorkspaceError, match="no prepare"):
            await sb.prepare(spec)
    finally:
        await sb.close()
