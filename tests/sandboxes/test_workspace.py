"""Workspaces on the local backend: persistence, limits, isolation, teardown, copy-on-write forks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentrl.sandboxes.workspace import (
    SetupFailed,
    WorkspaceExpired,
    WorkspaceFileError,
    WorkspaceSpec,
    WorkspaceUnsupported,
)

from .conftest import bwrap_skip_reason, processes_matching

pytestmark = pytest.mark.skipif(bwrap_skip_reason() is not None, reason=bwrap_skip_reason() or "")


@pytest.fixture
async def local() -> AsyncIterator[object]:
    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        yield sb


def marker() -> str:
    """A unique `sleep` argument to find a workspace's background process on the host."""
    return f"{4000 + uuid.uuid4().int % 5000}.{uuid.uuid4().int % 10**6}"


def ws_mounts() -> list[str]:
    return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if "agentrl-ws-" in ln]


async def gone(mark: str, timeout_s: float = 10.0) -> list[str]:
    """Host processes still matching `sleep <mark>` after a bounded wait."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_matching(f"sleep {mark}")) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def assert_nothing_left(mark: str, left: list[str]) -> None:
    from agentrl.sandboxes.local_workspace import leftover_dirs

    assert left == [], f"processes left: {left}"
    assert leftover_dirs() == []
    assert ws_mounts() == []
    cg = [p for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"))
          for p in root.rglob(f"agentrl-sbx-{os.getpid()}-ws*")] if Path("/sys/fs/cgroup/pids").exists() else []
    assert cg == []


async def test_files_and_processes_persist(local: object) -> None:
    mark = marker()
    async with local.workspace(WorkspaceSpec(files={"a.txt": "hello\n"}, setup=("echo set > s.txt",))) as ws:
        r = await ws.exec(f"cat a.txt s.txt; echo oops >&2; sleep {mark} & echo $! > bg.pid; exit 3")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "hello\nset\n", "oops\n", False)
        r = await ws.exec("kill -0 $(cat bg.pid) && echo alive; pwd; id -u")
        assert r.stdout == "alive\n/work\n65534\n"
        r = await ws.exec("tr a-z A-Z", stdin="abc")
        assert r.stdout == "ABC"
        r = await ws.exec("sleep 30", timeout_s=0.3)
        assert r.timed_out and r.exit_code == -signal.SIGKILL and not r.ok
        r = await ws.exec("yes | head -c 100000", max_output_bytes=1000)
        assert r.stdout_truncated and len(r.stdout) == 1000 and r.exit_code == 0
        await ws.write_file("sub/dir/b.bin", b"\x00\x01")
        assert await ws.read_file("/work/sub/dir/b.bin") == b"\x00\x01"
        assert (await ws.exec("wc -c < sub/dir/b.bin")).stdout.strip() == "2"
        assert await gone(mark, 0) != []  # alive while the workspace is
    assert_nothing_left(mark, await gone(mark))


async def test_file_rules(local: object) -> None:
    async with local.workspace(WorkspaceSpec(writable=("/logs",))) as ws:
        await ws.exec("ln -s /etc/hostname out; ln -s /.agentrl/_wsserver.py srv; mkfifo fifo; mkdir d; "
                      "echo in > real; ln -s real inlink")
        for bad in ("out", "srv", "fifo", "d", "missing", "/etc/hostname", "/proc/1/environ", "../etc/hostname"):
            with pytest.raises(WorkspaceFileError):
                await ws.read_file(bad)
        assert await ws.read_file("inlink") == b"in\n"  # a link that stays inside is followed
        with pytest.raises(WorkspaceFileError):
            await ws.write_file("/usr/evil", "x")
        with pytest.raises(WorkspaceFileError):
            await ws.write_file("out", "x")  # never through a link
        await ws.write_file("/logs/verdict.txt", "1")
        assert (await ws.exec("cat /logs/verdict.txt")).stdout == "1"


async def test_one_workspace_cannot_reach_another_or_the_host(local: object, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    mark = marker()
    async with local.workspace() as a, local.workspace() as b:
        await a.exec(f"echo mine > only_a.txt; sleep {mark} & echo $! > bg.pid")
        host_pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        sleeper = next(p for p in host_pids if f"sleep {mark}" in _cmdline(p))
        probe = (f"ls /work; cat {secret} 2>&1; ls /proc | grep -c '^[0-9]'; "
                 f"kill -9 {sleeper} 2>&1 || echo refused; kill -0 {os.getpid()} 2>&1 || echo refused; "
                 "ps -eo args 2>/dev/null | grep -c sleep")
        r = await b.exec(probe)
        lines = r.stdout.splitlines()
        assert "only_a.txt" not in r.stdout and "host secret" not in r.stdout
        assert int(lines[1]) <= 4  # its own server, shell, ls, grep: nothing of a's or the host's
        assert r.stdout.count("refused") == 2
        assert (await a.exec("kill -0 $(cat bg.pid) && echo alive")).stdout == "alive\n"
        # a command cannot signal its own workspace's server either (seccomp + PID 1)
        r = await a.exec("kill -9 1 2>&1; kill -KILL -1 2>&1; echo still")
        assert "still" in r.stdout
        assert (await a.exec("echo ok")).stdout == "ok\n"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def test_teardown_on_exception(local: object) -> None:
    mark = marker()
    with pytest.raises(RuntimeError, match="boom"):
        async with local.workspace() as ws:
            await ws.exec(f"sleep {mark} &")
            raise RuntimeError("boom")
    assert_nothing_left(mark, await gone(mark))


async def test_teardown_on_cancellation(local: object) -> None:
    mark = marker()
    started = asyncio.Event()

    async def episode() -> None:
        async with local.workspace() as ws:
            await ws.exec(f"sleep {mark} &")
            started.set()
            await ws.exec("sleep 60", timeout_s=120)

    task = asyncio.create_task(episode())
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_nothing_left(mark, await gone(mark))


async def test_teardown_after_a_killed_run(local: object) -> None:
    from agentrl.sandboxes.local_workspace import PREFIX

    mark = marker()
    script = textwrap.dedent(f"""
        import asyncio, sys
        from agentrl.sandboxes.local import LocalSandbox, LocalConfig
        async def main():
            async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
                async with sb.workspace() as ws:
                    await ws.exec("sleep {mark} &")
                    print("ready", flush=True)
                    await asyncio.sleep(600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        assert processes_matching(f"sleep {mark}")
        dead = proc.pid
        os.kill(dead, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert await gone(mark) == []  # --die-with-parent: the whole workspace dies with its run
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    assert list(tmp.glob(f"{PREFIX}{dead}-*"))  # its temp dir is left by the killed run ...
    async with local.workspace() as ws:  # ... and removed by the next start
        await ws.exec("true")
    assert list(tmp.glob(f"{PREFIX}{dead}-*")) == []


async def test_copy_on_write_forks(local: object) -> None:
    spec = WorkspaceSpec(setup=("echo run >> /work/setup.log; mkdir -p pkg && echo v1 > pkg/data; "
                                "echo old > doomed",))
    prepared = await local.prepare(spec)
    async with prepared:
        async with local.workspace(spec, prepared=prepared) as a, local.workspace(spec, prepared=prepared) as b:
            r = await a.exec("cat setup.log pkg/data; echo v2 > pkg/data; rm doomed; ls")
            assert r.stdout == "run\nv1\npkg\nsetup.log\n"
            r = await b.exec("cat setup.log pkg/data doomed")
            assert r.stdout == "run\nv1\nold\n"  # a's changes are a's alone
        async with local.workspace(spec, prepared=prepared) as c:
            assert (await c.exec("cat pkg/data; ls")).stdout == "v1\ndoomed\npkg\nsetup.log\n"
    from agentrl.sandboxes.local_workspace import leftover_dirs

    assert leftover_dirs() == []


async def test_limits(local: object) -> None:
    with pytest.raises(SetupFailed, match="exit code 7"):
        async with local.workspace(WorkspaceSpec(setup=("exit 7",))):
            pass
    async with local.workspace(WorkspaceSpec(lifetime_s=1.0)) as ws:
        await ws.exec("true")
        with pytest.raises(WorkspaceExpired):
            await ws.exec("sleep 5", timeout_s=10)
    async with local.workspace(WorkspaceSpec(disk_mb=8, max_processes=64)) as ws:
        r = await ws.exec("head -c 20000000 /dev/zero > f; echo rc=$?; du -m f | cut -f1")
        assert "rc=1" in r.stdout and int(r.stdout.split()[-1]) <= 8
        forks = ("import os, time\npids = []\ntry:\n    for _ in range(200):\n        p = os.fork()\n"
                 "        if p == 0:\n            time.sleep(30)\n            os._exit(0)\n        pids.append(p)\n"
                 "except OSError:\n    pass\nprint(len(pids))\nfor p in pids:\n    os.kill(p, 9)\n")
        with pytest.raises(WorkspaceFileError, match="No space left"):
            await ws.write_file("more", b"x" * 1_000_000)
        await ws.exec("rm f")
        await ws.write_file("forks.py", forks)
        r = await ws.exec("python3 forks.py", timeout_s=30)
        assert 8 < int(r.stdout) < 64  # the pids cgroup holds a fork bomb
        assert (await ws.exec("echo ok")).stdout == "ok\n"


async def test_the_server_starts_from_bytecode_and_imports_little(local: object) -> None:
    """A start compiles nothing and imports no json/re/enum (each costs every workspace start)."""
    from agentrl.sandboxes.local_workspace import SERVER_FILES

    async with local.workspace(WorkspaceSpec()) as ws:  # inside, as the server itself starts
        r = await ws.exec(f"{local.config.python} -I -S -v -c 'import sys; sys.path.insert(0, \"/.agentrl\"); "
                          "import _wsserver'")
        for name in SERVER_FILES:
            assert f"code object from '/.agentrl/__pycache__/{name[:-3]}." in r.stderr, r.stderr[-2000:]
    server_dir, python = local._dir, local.config.python
    code = ("import sys; base = set(sys.modules); sys.path.insert(0, sys.argv[1]); import _wsserver\n"
            "print(' '.join(sorted(set(sys.modules) - base)))")
    r = subprocess.run([python, "-I", "-S", "-v", "-c", code, str(server_dir)], capture_output=True, text=True,
                       timeout=60, check=True)
    for name in SERVER_FILES:  # loaded from the bytecode the sandbox compiled, not from source
        assert f"code object from '{server_dir}/__pycache__/{name[:-3]}." in r.stderr, r.stderr[-2000:]
    imported = set(r.stdout.split())
    assert {"_wsserver", "_forkserver"} <= imported
    heavy = {"json", "re", "enum", "base64", "selectors", "contextlib", "signal", "collections", "functools"}
    assert imported & heavy == set()


async def test_sandboxfusion_says_not_supported() -> None:
    from agentrl.sandboxes.sandboxfusion import SandboxFusionConfig, SandboxFusionSandbox

    sb = SandboxFusionSandbox(SandboxFusionConfig(url="http://127.0.0.1:9"))
    with pytest.raises(WorkspaceUnsupported, match="cannot hold a persistent workspace"):
        sb.workspace(WorkspaceSpec())
    with pytest.raises(WorkspaceUnsupported):
        await sb.prepare(WorkspaceSpec())
    await sb.close()


async def test_many_concurrent_workspaces_leave_nothing(local: object, caplog: pytest.LogCaptureFixture) -> None:
    """...and asyncio's child watcher reaps every chain: killing one must not also poll it (Popen.kill does),
    which raced the watcher ("Unknown child process pid N, will report returncode 255" in a run's log)."""
    mark = marker()
    codes: list[int | None] = []

    async def one(i: int) -> str:
        async with local.workspace(WorkspaceSpec(disk_mb=16)) as ws:
            await ws.exec(f"sleep {mark} & echo {i} > n")
            out = (await ws.exec("cat n")).stdout
        codes.append(ws.proc.returncode)
        return out

    with caplog.at_level("WARNING", logger="asyncio"):
        outs = await asyncio.gather(*(one(i) for i in range(16)))
    assert outs == [f"{i}\n" for i in range(16)]
    assert codes == [-signal.SIGKILL] * 16  # the watcher's report of the kill, not its 255 for a child gone
    assert not [r for r in caplog.records if "Unknown child process" in r.getMessage()]
    assert_nothing_left(mark, await gone(mark))
