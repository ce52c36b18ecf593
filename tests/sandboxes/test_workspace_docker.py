"""Workspaces on the docker backend: one container each, persistence, isolation, teardown, committed forks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentrl.sandboxes.workspace import WorkspaceFileError, WorkspaceSpec

pytestmark = pytest.mark.docker

LABEL = "org.agentrl.sandbox"


@pytest.fixture
async def docker_sb(docker_reason: str | None) -> AsyncIterator[Any]:
    if docker_reason:
        pytest.skip(docker_reason)
    from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

    sb = DockerSandbox(DockerConfig(pool_size=1))
    try:
        yield sb
    finally:
        await sb.close()


def ours(sb: Any, kind: str = "containers") -> list[Any]:
    """Containers (or images) of this process."""
    objs = getattr(sb.client, kind).list(**({"all": True} if kind == "containers" else {}),
                                        filters={"label": f"{LABEL}={sb.owner}"})
    return list(objs)


async def test_persistence_limits_and_no_network(docker_sb: Any) -> None:
    async with docker_sb.workspace(WorkspaceSpec(files={"a.txt": "hi\n"}, writable=("/logs",))) as ws:
        r = await ws.exec("cat a.txt; sleep 300 & echo $! > bg.pid; exit 4")
        assert (r.exit_code, r.stdout) == (4, "hi\n")
        r = await ws.exec("kill -0 $(cat bg.pid) && echo alive; ls /sys/class/net")
        assert r.stdout == "alive\nlo\n"  # no network: only loopback
        r = await ws.exec("sleep 30", timeout_s=0.5)
        assert r.timed_out
        await ws.exec("ln -s /etc/passwd out")
        with pytest.raises(WorkspaceFileError):
            await ws.read_file("out")
        await ws.write_file("/logs/r.txt", "1")
        assert await ws.read_file("/logs/r.txt") == b"1"
        (container,) = ours(docker_sb)
        assert container.attrs["HostConfig"]["NetworkMode"] == "none"
    assert ours(docker_sb) == []


async def test_isolation_and_teardown(docker_sb: Any) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with docker_sb.workspace() as a, docker_sb.workspace() as b:
            await a.exec("echo mine > only_a; sleep 300 &")
            r = await b.exec("ls /work; ps -e 2>/dev/null | grep -c sleep || true")
            assert "only_a" not in r.stdout and r.stdout.strip().endswith("0")
            raise RuntimeError("boom")
    assert ours(docker_sb) == []
    started = asyncio.Event()

    async def episode() -> None:
        async with docker_sb.workspace() as ws:
            started.set()
            await ws.exec("sleep 60", timeout_s=120)

    task = asyncio.create_task(episode())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ours(docker_sb) == []


async def test_committed_forks(docker_sb: Any) -> None:
    spec = WorkspaceSpec(setup=("echo run >> setup.log; echo v1 > data",))
    prepared = await docker_sb.prepare(spec)
    async with (prepared, docker_sb.workspace(spec, prepared=prepared) as a,
                docker_sb.workspace(spec, prepared=prepared) as b):
        assert (await a.exec("cat setup.log data; echo v2 > data")).stdout == "run\nv1\n"
        assert (await b.exec("cat data")).stdout == "v1\n"
    assert ours(docker_sb) == [] and ours(docker_sb, "images") == []


async def test_a_killed_runs_container_is_removed_by_the_next_start(docker_sb: Any) -> None:
    script = textwrap.dedent("""
        import asyncio
        from agentrl.sandboxes.docker import DockerSandbox, DockerConfig
        async def main():
            sb = DockerSandbox(DockerConfig(pool_size=1))
            async with sb.workspace() as ws:
                await ws.exec("true")
                print("ready", flush=True)
                await asyncio.sleep(600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        dead = f"{docker_sb.owner.rpartition(':')[0]}:{proc.pid}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    left = docker_sb.client.containers.list(all=True, filters={"label": f"{LABEL}={dead}"})
    assert len(left) == 1  # a killed client leaves its container running ...
    async with docker_sb.workspace() as ws:
        await ws.exec("true")
    assert docker_sb.client.containers.list(all=True, filters={"label": f"{LABEL}={dead}"}) == []  # ... until now


async def test_lifetime_removes_the_container(docker_sb: Any) -> None:
    from agentrl.sandboxes.workspace import WorkspaceExpired

    async with docker_sb.workspace(WorkspaceSpec(lifetime_s=1.5)) as ws:
        await ws.exec("true")
        with pytest.raises(WorkspaceExpired):
            await ws.exec("sleep 20", timeout_s=30)
    assert ours(docker_sb) == []
