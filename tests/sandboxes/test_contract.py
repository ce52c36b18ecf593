"""The request/response contract, the same on every backend that runs here."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentrl.sandboxes.base import ExecRequest

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker),
            pytest.param("docker-server", marks=pytest.mark.docker), "e2b", "sandboxfusion"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_python_and_bash_with_files_stdin_and_exit_codes(
    backend: str, backend_opener: Any, request: pytest.FixtureRequest
) -> None:
    async with backend_opener(backend, request) as sb:
        r = await sb.run(ExecRequest(
            code="import sys, data\nprint(data.X + int(sys.stdin.read()))\nprint('err', file=sys.stderr)\n"
                 "open('out.txt', 'w').write('made')\n",
            files={"data.py": "X = 40\n", "blob.bin": b"\x00\x01"},
            fetch_files=["out.txt"],
            stdin="2",
        ))
        assert r.status == "ok", r
        assert r.exit_code == 0 and r.stdout == "42\n" and r.stderr == "err\n"
        assert r.files == {"out.txt": b"made"}
        assert r.wall_s > 0

        r = await sb.run(ExecRequest(code="echo hi; cat; exit 3", language="bash", stdin="in\n"))
        assert (r.status, r.exit_code, r.stdout) == ("error", 3, "hi\nin\n")

        r = await sb.run(ExecRequest(code="raise ValueError('boom')"))
        assert r.status == "error" and r.exit_code == 1 and "ValueError: boom" in r.stderr

        r = await sb.run(ExecRequest(code="def f(:\n"))
        assert r.status == "error" and "SyntaxError" in r.stderr

        r = await sb.run(ExecRequest(code="import os\nprint(os.getuid())"))
        assert r.status == "ok" and r.stdout.strip() != "0", "code must not run as root"

        r = await sb.run(ExecRequest(code="print('x' * 50)", max_output_bytes=10))
        assert r.status == "output_limit" and r.stdout == "x" * 10 and r.stdout_truncated


async def test_many_concurrent_callers(backend: str, backend_opener: Any, request: pytest.FixtureRequest) -> None:
    async with backend_opener(backend, request) as sb:
        n = 24 if backend != "docker" else 8
        results = await asyncio.wait_for(
            asyncio.gather(*(sb.run(ExecRequest(code=f"print({i} * 2)")) for i in range(n))), 120)
        assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(n)]
        assert {r.status for r in results} == {"ok"}


async def test_argv_requests(backend: str, backend_opener: Any, request: pytest.FixtureRequest) -> None:
    if backend == "sandboxfusion":
        async with backend_opener(backend, request) as sb:
            r = await sb.run(ExecRequest(argv=["echo", "x"]))
            assert r.status == "sandbox_error" and "argv" in r.message
        return
    async with backend_opener(backend, request) as sb:
        r = await sb.run(ExecRequest(argv=["python3", "-I", "-S", "tool.py", "a b"],
                                     files={"tool.py": "import sys; print(sys.argv[1:])"}))
        assert r.status == "ok" and r.stdout == "['a b']\n", r
        r = await sb.run(ExecRequest(argv=["definitely-not-a-command"]))
        assert r.status == "error" and r.exit_code == 127, r


async def test_network_request_is_refused_by_default(
    backend: str, backend_opener: Any, request: pytest.FixtureRequest
) -> None:
    async with backend_opener(backend, request) as sb:
        if backend == "e2b":
            pytest.skip("e2b sandboxes decide network access at creation (template/allow_internet_access)")
        r = await sb.run(ExecRequest(code="print(1)", network=True))
        assert r.status == "sandbox_error" and "network" in r.message


#: Links out of the work dir (absolute, relative, through a linked directory, /proc magic links),
#: links that stay inside, and a missing file.
LINKS = (
    "import os\n"
    "os.symlink('/etc/passwd', 'passwd.txt')\n"
    "os.symlink('/proc/1/environ', 'environ.txt')\n"
    "os.symlink('/proc/self/cwd/../../etc/hostname', 'hostname.txt')\n"
    "os.symlink('../../../../../../etc/passwd', 'relative.txt')\n"
    "os.symlink('/', 'root')\n"
    "os.makedirs('sub')\n"
    "open('sub/real.txt', 'w').write('inside')\n"
    "os.symlink('sub/real.txt', 'inner.txt')\n"
    "os.symlink(os.path.abspath('sub'), 'subdir')\n"
    "open('plain.txt', 'w').write('plain')\n"
)


async def test_fetch_files_never_follow_a_link_out_of_the_work_dir(
    backend: str, backend_opener: Any, request: pytest.FixtureRequest
) -> None:
    """A returned file is read from inside the work dir or not at all: the same rule on every backend."""
    async with backend_opener(backend, request) as sb:
        r = await sb.run(ExecRequest(
            code=LINKS, wall_timeout_s=10,
            fetch_files=["passwd.txt", "environ.txt", "hostname.txt", "relative.txt", "root/etc/passwd",
                         "inner.txt", "subdir/real.txt", "missing.txt", "plain.txt"],
        ))
        assert r.status == "ok", r
        assert r.files == {"plain.txt": b"plain", "inner.txt": b"inside", "subdir/real.txt": b"inside"}, r.files


async def test_fetch_files_returns_regular_files_only(
    backend: str, backend_opener: Any, request: pytest.FixtureRequest
) -> None:
    """A FIFO or a directory named in fetch_files is left out; opening the FIFO must not hang the backend."""
    async with backend_opener(backend, request) as sb:
        r = await sb.run(ExecRequest(
            code="import os\nos.mkfifo('fifo.txt')\nos.mkdir('dir.txt')\nopen('plain.txt', 'w').write('plain')\n",
            wall_timeout_s=10, fetch_files=["fifo.txt", "dir.txt", "plain.txt"],
        ))
        assert r.status == "ok", r
        assert r.files == {"plain.txt": b"plain"}, r.files
