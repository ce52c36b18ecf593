"""The hazard suite: hostile code against every backend that runs here.

Each hazard must be contained: the right status, the host untouched (files,
secrets, network, processes), nothing left running, and the same pool serves
the next request. Backends: local (bubblewrap), docker (when a daemon and the
image exist), e2b (the real SDK against a local protocol server) and
sandboxfusion (a local server with its schema); the last two execute in
bubblewrap on the server side, so for them the suite checks the client's
status mapping end to end.

Set AGENTRL_HAZARD_TABLE=path to write the backend x hazard table (markdown).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentrl.sandboxes.base import ExecRequest, ExecResult

pytestmark = [pytest.mark.hazard, pytest.mark.asyncio(loop_scope="module")]

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker),
            pytest.param("docker-server", marks=pytest.mark.docker), "e2b", "sandboxfusion"]
SECRET_ENV = "AGENTRL_HAZARD_SECRET"


@dataclass
class Harness:
    name: str
    sb: Any
    token: str
    host_dir: Path
    baseline: int


@pytest.fixture(scope="session")
def hazard_table() -> Iterator[dict[tuple[str, str], str]]:
    table: dict[tuple[str, str], str] = {}
    yield table
    path = os.environ.get("AGENTRL_HAZARD_TABLE")
    if path and table:
        backends = sorted({b for b, _ in table}, key=["local", "docker", "docker-server", "e2b", "sandboxfusion"].index)
        hazards = list(dict.fromkeys(h for _, h in table))
        lines = ["| hazard | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
        for h in hazards:
            lines.append(f"| {h} | " + " | ".join(table.get((b, h), "-") for b in backends) + " |")
        Path(path).write_text("\n".join(lines) + "\n")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def harness(
    request: pytest.FixtureRequest, backend_opener: Any, proc_tools: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Harness]:
    token = secrets.token_hex(16)
    os.environ[SECRET_ENV] = token  # in the parent's environment before the backend starts
    host_dir = tmp_path_factory.mktemp("hazard-host")
    host_dir.chmod(0o755)
    (host_dir / "secret.txt").write_text(token)
    (host_dir / "secret.txt").chmod(0o644)  # readable by anyone on the host: only isolation protects it
    try:
        async with backend_opener(request.param, request) as sb:
            warm = await asyncio.gather(*(sb.run(ExecRequest(code="print(1)")) for _ in range(2)))
            assert all(r.status == "ok" for r in warm), warm
            yield Harness(request.param, sb, token, host_dir, len(proc_tools.nobody()))
    finally:
        os.environ.pop(SECRET_ENV, None)


async def contained(h: Harness, proc_tools: Any, result: ExecResult, table: dict[tuple[str, str], str],
                    hazard: str) -> None:
    """Common checks after a hazard: no sandbox error, pool serves, nothing left behind."""
    table[(h.name, hazard)] = result.status
    after = await h.sb.run(ExecRequest(code="print('alive')"))
    assert after.status == "ok" and after.stdout == "alive\n", after
    procs = await proc_tools.settle(h.baseline)
    assert len(procs) <= h.baseline, f"processes left behind: {procs}"
    table[(h.name, hazard)] = f"{result.status} ✓"


async def test_fork_bomb(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = await harness.sb.run(ExecRequest(code=code, wall_timeout_s=2, max_processes=32))
    assert r.status == "timeout", r
    await contained(harness, proc_tools, r, hazard_table, "fork bomb")


async def test_memory_bomb(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    r = await harness.sb.run(ExecRequest(code=code, wall_timeout_s=20, memory_mb=256))
    assert r.status == "oom", r
    await contained(harness, proc_tools, r, hazard_table, "memory bomb")


async def test_cpu_spin(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    r = await harness.sb.run(ExecRequest(code="while True:\n    pass\n", wall_timeout_s=3, cpu_time_s=1))
    assert r.status == "timeout", r
    await contained(harness, proc_tools, r, hazard_table, "CPU spin")


async def test_sleep_forever(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    r = await harness.sb.run(ExecRequest(code="import time\ntime.sleep(10**6)\n", wall_timeout_s=1.5))
    assert r.status == "timeout", r
    await contained(harness, proc_tools, r, hazard_table, "sleep forever")


async def test_big_file(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = ("with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'\\0' * (1 << 20))\n"
            "print('wrote 1 GB')\n")
    r = await harness.sb.run(ExecRequest(code=code, wall_timeout_s=20))
    assert r.status == "error", r
    assert "wrote 1 GB" not in r.stdout
    assert "File too large" in r.stderr or "No space left" in r.stderr, r.stderr
    await contained(harness, proc_tools, r, hazard_table, "1 GB file write")


async def test_output_flood(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    r = await harness.sb.run(ExecRequest(code=code, wall_timeout_s=10, max_output_bytes=100_000))
    assert r.status == "output_limit", r.model_copy(update={"stdout": r.stdout[:100]})
    assert r.stdout_truncated and 0 < len(r.stdout) <= 100_000
    await contained(harness, proc_tools, r, hazard_table, "output flood")


async def test_network_connect(harness: Harness, proc_tools: Any,
                               hazard_table: dict[tuple[str, str], str]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[1])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (
        "import socket\n"
        f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close()\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, type(e).__name__)\n"
    )
    try:
        r = await harness.sb.run(ExecRequest(code=code, wall_timeout_s=15))
    finally:
        stop.set()
        t.join(2)
        listener.close()
    assert r.status == "ok", r
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 3, r.stdout
    assert accepted == []
    await contained(harness, proc_tools, r, hazard_table, "network connect")


async def test_host_secret_file(harness: Harness, proc_tools: Any,
                                hazard_table: dict[tuple[str, str], str]) -> None:
    secret = harness.host_dir / "secret.txt"
    code = (
        "import glob\n"
        f"paths = [{str(secret)!r}, '/etc/shadow', '/root/.bashrc'] + glob.glob('/tmp/**/secret.txt', recursive=True)\n"
        "for p in paths:\n"
        "    try:\n"
        "        print(open(p).read())\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    r = await harness.sb.run(ExecRequest(code=code))
    assert r.status == "ok", r
    assert harness.token not in r.stdout + r.stderr
    assert f"denied {secret}" in r.stdout
    await contained(harness, proc_tools, r, hazard_table, "host secret file")


async def test_parent_env_var(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = (
        "import os\n"
        f"print('env:', os.environ.get({SECRET_ENV!r}))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
    )
    r = await harness.sb.run(ExecRequest(code=code))
    assert r.status == "ok", r
    assert "env: None" in r.stdout
    assert harness.token not in r.stdout + r.stderr
    await contained(harness, proc_tools, r, hazard_table, "parent env var")


async def test_write_outside_workdir(harness: Harness, proc_tools: Any,
                                     hazard_table: dict[tuple[str, str], str]) -> None:
    targets = [harness.host_dir / "pwned.txt", Path(f"/tmp/agentrl-pwned-{harness.token}"),
               Path("/usr/agentrl-pwned"), Path("/etc/agentrl-pwned"), Path("/agentrl-pwned")]
    code = (
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('pwned')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    r = await harness.sb.run(ExecRequest(code=code))
    assert r.status == "ok", r
    for t in targets:
        assert not t.exists(), f"{t} was written on the host"
    await contained(harness, proc_tools, r, hazard_table, "write outside work dir")


async def test_setsid_orphan(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    marker = f"4242.{secrets.randbelow(10**6)}"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent done')\n"
    )
    r = await harness.sb.run(ExecRequest(code=code))
    assert r.status == "ok" and "parent done" in r.stdout, r
    for _ in range(100):  # bounded wait: docker/e2b clean up right after answering
        if not proc_tools.matching(f"sleep {marker}"):
            break
        await asyncio.sleep(0.05)
    assert proc_tools.matching(f"sleep {marker}") == []
    await contained(harness, proc_tools, r, hazard_table, "setsid orphan")


async def test_signal_parent(harness: Harness, proc_tools: Any, hazard_table: dict[tuple[str, str], str]) -> None:
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('sent', target)\n"
        "    except OSError as e:\n"
        "        print('refused', target, type(e).__name__)\n"
        "print('still here')\n"
    )
    r = await harness.sb.run(ExecRequest(code=code))
    assert r.status in ("ok", "error"), r
    await contained(harness, proc_tools, r, hazard_table, "signal parent")
