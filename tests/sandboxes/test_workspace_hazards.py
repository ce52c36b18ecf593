"""The hazard programs against workspaces: each is contained and the workspace keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentrl.sandboxes.workspace import WorkspaceSpec

from .conftest import bwrap_skip_reason

pytestmark = pytest.mark.hazard

NET = ("python3 -c \"import socket; s = socket.socket(); s.settimeout(2)\ntry:\n    s.connect(('1.1.1.1', 53))\n"
       "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\"")
FORKS = ("python3 -c \"import os, time\npids = []\ntry:\n    for _ in range(500):\n        p = os.fork()\n"
         "        if p == 0:\n            time.sleep(20)\n            os._exit(0)\n        pids.append(p)\n"
         "except OSError:\n    pass\nprint(len(pids))\nfor p in pids:\n    os.kill(p, 9)\"")


async def open_workspace(backend: str, request: pytest.FixtureRequest, spec: WorkspaceSpec) -> tuple[Any, Any]:
    if backend == "local":
        if bwrap_skip_reason():
            pytest.skip(bwrap_skip_reason() or "")
        from agentrl.sandboxes.local import LocalSandbox

        sb: Any = LocalSandbox()
    else:
        reason = request.getfixturevalue("docker_reason")
        if reason:
            pytest.skip(reason)
        from agentrl.sandboxes.docker import DockerSandbox

        sb = DockerSandbox()
    return sb, await sb.workspace(spec).start()


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
async def test_hazards_are_contained(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("TOPSECRET")
    sb, ws = await open_workspace(backend, request, WorkspaceSpec(memory_mb=256, max_processes=64, disk_mb=32))
    try:
        r = await ws.exec("python3 -c 'x = bytearray(1 << 31)'; echo rc=$?", timeout_s=60)
        assert "rc=" in r.stdout and "rc=0" not in r.stdout  # memory bomb: killed or MemoryError
        r = await ws.exec(FORKS, timeout_s=60)
        assert int(r.stdout.split()[-1]) < 64  # fork bomb: held by the pids limit
        r = await ws.exec("yes", timeout_s=2, max_output_bytes=10_000)
        assert r.timed_out and r.stdout_truncated and len(r.stdout) == 10_000  # output flood: capped
        r = await ws.exec(NET, timeout_s=10)
        assert r.stdout.startswith("refused")  # no network
        r = await ws.exec(f"cat {secret} 2>&1; echo $AGENTRL_SECRET_PROBE; env | grep -c PYTEST || true")
        assert "TOPSECRET" not in r.stdout and r.stdout.strip().endswith("0")  # host files, parent env
        r = await ws.exec("head -c 100000000 /dev/zero > big 2>/dev/null; echo rc=$?; rm -f big", timeout_s=60)
        if backend == "local":
            assert "rc=1" in r.stdout  # disk: a full tmpfs
        r = await ws.exec("setsid sleep 300 & kill -9 1 2>&1; kill -KILL -1 2>&1; echo after")
        assert "after" in r.stdout
        assert (await ws.exec("echo still serving")).stdout == "still serving\n"
    finally:
        await ws.close()
        await sb.close()
