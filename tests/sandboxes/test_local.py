"""The local (bubblewrap + fork server) backend: isolation, pool behaviour, refusal."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal

import pytest

from agentrl.sandboxes.base import ExecRequest
from agentrl.sandboxes.local import LocalConfig, LocalSandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@needs_bwrap
async def test_nothing_carries_over_between_requests() -> None:
    """Request A writes files, globals, env vars and a module; B (same worker) sees none of it."""
    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        a = await sb.run(ExecRequest(code=(
            "import builtins, os, sys, types\n"
            "open('/work/a.txt', 'w').write('A'); open('/tmp/b.txt', 'w').write('A')\n"
            "open('/dev/shm/c.txt', 'w').write('A')\n"
            "os.makedirs('/work/sub', exist_ok=True); open('/work/sub/d.txt', 'w').write('A')\n"
            "builtins.LEAK = 'A'; os.environ['LEAK'] = 'A'\n"
            "sys.modules['leaky'] = types.ModuleType('leaky')\n"
            "print(os.getpid(), os.getppid())\n"
        )))
        assert a.status == "ok", a
        b = await sb.run(ExecRequest(code=(
            "import builtins, os, sys\n"
            "print(sorted(os.listdir('/work')), sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))\n"
            "print(hasattr(builtins, 'LEAK'), 'LEAK' in os.environ, 'leaky' in sys.modules)\n"
            "print(os.getpid(), os.getppid())\n"
        )))
        assert b.status == "ok", b
        lines = b.stdout.splitlines()
        assert lines[0] == "['main.py'] [] []"
        assert lines[1] == "False False False"
        # same fork server (PID 1) served both, each request in a fresh process
        assert a.stdout.split()[1] == lines[2].split()[1] == "1"
        assert len(sb.workers()) == 1


@needs_bwrap
async def test_sandbox_view_of_the_system() -> None:
    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        r = await sb.run(ExecRequest(code=(
            "import os\n"
            "print(os.getuid(), os.getgid())\n"
            "print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])\n"
            "print(sorted(os.environ))\n"
            "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
            "try:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n"
        )))
        assert r.status == "ok", r
        uid, ifaces, env, nprocs, ro = r.stdout.splitlines()
        assert uid == "65534 65534"
        assert ifaces == "['lo']"
        assert "HOME" in env and "AGENTRL" not in env
        assert nprocs == "2"  # the fork server and this process: the host is invisible
        assert ro in ("OSError", "PermissionError")


async def test_refuses_without_bubblewrap() -> None:
    with pytest.raises(RuntimeError, match="unsafe_local"):
        LocalSandbox(LocalConfig(bwrap="/nonexistent/bwrap"))


async def test_unsafe_local_warns_loudly_and_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agentrl.sandboxes.local"):
        sb = LocalSandbox(LocalConfig(bwrap="/nonexistent/bwrap", unsafe_local=True, pool_size=1))
    assert any("UNSAFE" in rec.message for rec in caplog.records)
    async with sb:
        r = await sb.run(ExecRequest(code="open('x', 'w').write('1'); print(open('x').read())"))
        assert r.status == "ok" and r.stdout == "1\n", r
        r = await sb.run(ExecRequest(code="import os; print(os.listdir('.'))"))
        assert r.stdout == "['main.py']\n"  # the work dir is still wiped between requests
        r = await sb.run(ExecRequest(code="import time; time.sleep(100)", wall_timeout_s=0.5))
        assert r.status == "timeout"


@needs_bwrap
async def test_dead_worker_is_replaced() -> None:
    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        (worker,) = sb.workers()
        os.killpg(worker.proc.pid, signal.SIGKILL)
        await asyncio.wait_for(worker.proc.wait(), 10)
        r = await sb.run(ExecRequest(code="print('back')"))
        assert r.status == "ok" and r.stdout == "back\n"
        assert sb.workers() and sb.workers()[0] is not worker


@needs_bwrap
async def test_workers_are_recycled_after_max_uses() -> None:
    async with LocalSandbox(LocalConfig(pool_size=1, max_uses=2)) as sb:
        first = sb.workers()[0]
        for _ in range(3):
            assert (await sb.run(ExecRequest(code="pass"))).ok
        assert first not in sb.workers()


@needs_bwrap
async def test_pool_limits_concurrency_and_queues() -> None:
    async with LocalSandbox(LocalConfig(pool_size=2)) as sb:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, sb.limiter.running)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(sb.run(ExecRequest(code="import time; time.sleep(0.05)"))
                                         for _ in range(8)))
        watcher.cancel()
        assert all(r.ok for r in results)
        assert peak == 2
        assert len(sb.workers()) == 2


@needs_bwrap
async def test_fresh_mode_and_cgroups() -> None:
    async with LocalSandbox(LocalConfig(mode="fresh")) as sb:
        r = await sb.run(ExecRequest(code="print('fresh')"))
        assert r.status == "ok" and r.stdout == "fresh\n"
        assert sb.workers() == []


@needs_bwrap
async def test_closed_sandbox_reports_sandbox_error() -> None:
    sb = LocalSandbox(LocalConfig(pool_size=1))
    async with sb:
        pass
    r = await sb.run(ExecRequest(code="print(1)"))
    assert r.status == "sandbox_error" and "closed" in r.message


@needs_bwrap
async def test_bash_fork_bomb_and_memory_bomb_are_contained() -> None:
    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        r = await sb.run(ExecRequest(code=":(){ :|:& };:", language="bash", wall_timeout_s=2, max_processes=16))
        # the main shell may return at once (the bomb runs in the background) or flood stderr with
        # "fork: retry": either way everything it started is killed before the answer
        assert r.status in ("ok", "timeout", "output_limit"), r
        r = await sb.run(ExecRequest(code="x=$(printf '%*s' 400000000 ''); echo ${#x}", language="bash",
                                     wall_timeout_s=20, memory_mb=128))
        assert r.status == "oom" and "cannot allocate" in r.stderr, r
        r = await sb.run(ExecRequest(code="import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))"))
        assert r.ok and r.stdout == "2\n"  # only the fork server and this process are left
