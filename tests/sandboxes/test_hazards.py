"""The hazard suite: hostile code against every backend that runs here.

Each hazard must be contained: the right status, the host untouched (files,
secrets, network, processes), nothing left running, and the same pool serves
the next request. Backends: local (bubblewrap), docker (when a daemon and the
image exist), e2b (the real SDK against a local protocol server) and
sandboxfusion (a local server with its schema); the last two execute in
bubblewrap on the server side, so for them the suite checks the client's
status mapping end to end.

The fork-server hazards (ptrace, /proc files, signals of the supervisor) and the
leftover hazards (what one request could leave in a warm worker for the next:
files, IPC objects, keys, the server's rlimits/priority/OOM score, the work
dir's mode) apply to the backends whose warm workers are ours: local, docker
(exec) and docker (server). e2b and sandboxfusion run on a service's own
workers (here: fakes that execute on the local backend), so they are skipped.

Set AGENTRL_HAZARD_TABLE=path to write the backend x hazard table (markdown).
"""

from __future__ import annotations

import asyncio
import os
import platform
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


# -- the fork server is out of its children's reach ---------------------------------------------

#: Backends whose requests run under our fork server (a warm one for local and docker server mode).
FORK_SERVER_BACKENDS = ("local", "docker", "docker-server")
#: syscall numbers the hostile programs below use through ctypes (they differ per architecture)
_NR = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}
NR = _NR.get(platform.machine(), _NR["x86_64"])


def needs_fork_server(h: Harness) -> None:
    if h.name not in FORK_SERVER_BACKENDS:
        pytest.skip(f"{h.name} runs code on the service's own workers (no fork server of ours)")


PTRACE_PARENT = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pp = os.getppid()
rc = libc.ptrace(16, pp, 0, 0)  # PTRACE_ATTACH
print("attach", rc, ctypes.get_errno())
if rc == 0:
    os.waitpid(pp, 0x40000000)  # __WALL: wait for the stop, then let it go
    print("detach", libc.ptrace(17, pp, 0, 0), ctypes.get_errno())
rc = libc.ptrace(0x4206, pp, 0, 0)  # PTRACE_SEIZE
print("seize", rc, ctypes.get_errno())
if rc == 0:
    print("detach", libc.ptrace(17, pp, 0, 0), ctypes.get_errno())

class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

buf = ctypes.create_string_buffer(64)
local, remote = IoVec(ctypes.addressof(buf), 64), IoVec(id(os), 64)  # forked: same addresses there
print("vm_read", libc.process_vm_readv(pp, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno())
print("vm_write", libc.process_vm_writev(pp, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0),
      ctypes.get_errno())
'''


async def test_ptrace_fork_server(harness: Harness, proc_tools: Any,
                                  hazard_table: dict[tuple[str, str], str]) -> None:
    """Code cannot attach to (or read/write the memory of) the fork server that serves later requests."""
    needs_fork_server(harness)
    r = await harness.sb.run(ExecRequest(code=PTRACE_PARENT))
    assert r.status == "ok", r
    assert r.stdout.splitlines() == ["attach -1 1", "seize -1 1", "vm_read -1 1", "vm_write -1 1"], r.stdout
    await contained(harness, proc_tools, r, hazard_table, "ptrace the fork server")


SERVER_PROC_FILES = r'''
import os
pp = os.getppid()
for name, mode in [("mem", "rb"), ("environ", "rb"), ("maps", "rb"), ("fd/4", "wb"), ("fd/3", "rb"),
                   ("oom_score_adj", "w"), ("root/work", None), ("fd", None)]:
    path = f"/proc/{pp}/{name}"
    try:
        if mode is None:
            os.listdir(path)
        else:
            open(path, mode).close()
        print("opened", name)
    except OSError as e:
        print("denied", name, type(e).__name__)
'''


async def test_fork_server_proc_files(harness: Harness, proc_tools: Any,
                                      hazard_table: dict[tuple[str, str], str]) -> None:
    """The fork server's /proc/<pid>/mem, environ, maps, fd/* (its control pipes), root, oom_score_adj are shut."""
    needs_fork_server(harness)
    r = await harness.sb.run(ExecRequest(code=SERVER_PROC_FILES))
    assert r.status == "ok", r
    assert "opened" not in r.stdout, r.stdout
    assert r.stdout.count("denied") == 8, r.stdout
    await contained(harness, proc_tools, r, hazard_table, "fork server /proc files")


SIGNAL_SERVER = r'''
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
pp = os.getppid()
procfd = os.open(f"/proc/{pp}", os.O_RDONLY | os.O_DIRECTORY)  # a pidfd for pidfd_send_signal

def pidfd_send(s):
    if libc.syscall(424, procfd, int(s), None, 0) != 0:
        raise OSError(ctypes.get_errno(), "pidfd_send_signal")

for name, call in [("kill", lambda s: os.kill(pp, s)), ("group", lambda s: os.killpg(os.getpgid(pp), s)),
                   ("all", lambda s: os.kill(-1, s)), ("pidfd", pidfd_send)]:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):
        try:
            call(s)
            print("sent", name, s.name)
        except OSError as e:
            print("refused", name, s.name, type(e).__name__)
print("still here")
'''


async def test_signal_fork_server(harness: Harness, proc_tools: Any,
                                  hazard_table: dict[tuple[str, str], str]) -> None:
    """Signals to the fork server (by pid, its group, everyone, or through a pidfd) are refused, on every mode."""
    needs_fork_server(harness)
    r = await harness.sb.run(ExecRequest(code=SIGNAL_SERVER))
    assert r.status == "ok" and r.stdout.endswith("still here\n"), r
    assert "sent" not in r.stdout, r.stdout
    await contained(harness, proc_tools, r, hazard_table, "signal the fork server")


# -- nothing a request does reaches the next one on the same warm worker ------------------------

#: A known program that prints everything of its process and worker a previous request could have
#: changed. On a worker that serves it twice, with a hostile request in between, it must print the
#: same both times.
STATE_PROBE = r'''
import ctypes, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
print("known program")
print("rlimits", [(n, resource.getrlimit(getattr(resource, n))) for n in sorted(dir(resource))
                  if n.startswith("RLIMIT_")])
print("nice", os.getpriority(os.PRIO_PROCESS, 0), "affinity", sorted(os.sched_getaffinity(0)),
      "policy", os.sched_getscheduler(0))
print("oom_score_adj", open("/proc/self/oom_score_adj").read().strip())
print("umask", oct(os.umask(0o022)), "cwd", os.getcwd())
print("env", sorted(os.environ.items()))
print("signals", [(int(s), str(signal.getsignal(s))) for s in sorted(signal.valid_signals())
                  if s not in (signal.SIGKILL, signal.SIGSTOP)])
print("blocked", sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
for d in ("/work", "/tmp", "/dev/shm", "/dev", "/dev/mqueue"):
    try:
        st = os.stat(d)
        print(d, sorted(os.listdir(d)), oct(st.st_mode), st.st_uid, sorted(os.listxattr(d)))
    except OSError as e:
        print(d, type(e).__name__)
for kind in ("shm", "sem", "msg"):
    try:
        print("sysv", kind, [ln.split()[:2] for ln in open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]])
    except OSError as e:
        print("sysv", kind, type(e).__name__)
for ring in (-3, -4):  # the session and the user keyring
    print("key", ring, libc.syscall(KEYCTL, 10, ring, b"user", b"agentrl-leftover", 0) >= 0)
print("mqueue", libc.mq_open(b"/agentrl-leftover", os.O_RDONLY) >= 0)
'''.replace("KEYCTL", str(NR["keyctl"]))

#: What one request tries to leave behind for the next (each entry is one hazard-table row).
LEFTOVERS: dict[str, str] = {
    "leftover files (/tmp, /dev/shm, /dev)": (
        "for p in ('/tmp/left', '/dev/shm/left', '/dev/left', '/work/.left'):\n"
        "    try:\n        open(p, 'w').write('A')\n    except OSError:\n        pass\n"
    ),
    "leftover SysV IPC objects": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0x5151, 4096, 0o1666), libc.semget(0x5152, 1, 0o1666), libc.msgget(0x5153, 0o1666))\n"
    ),
    "leftover POSIX message queue": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mq_open(b'/agentrl-leftover', os.O_CREAT | os.O_RDWR, 0o600, None))\n"
    ),
    "leftover keys (session/user keyring)": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for ring in (-3, -4):\n"
        f"    print(libc.syscall({NR['add_key']}, b'user', b'agentrl-leftover', b'A', 1, ring))\n"
    ),
    "fork server rlimits": (
        "import os, resource\n"
        "for kind, value in ((resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_STACK, (1 << 20, 1 << 20))):\n"
        "    try:\n        resource.prlimit(os.getppid(), kind, value)\n    except (OSError, ValueError) as e:\n"
        "        print('refused', e)\n"
    ),
    "fork server priority and CPUs": (
        "import os\n"
        "for call in (lambda: os.setpriority(os.PRIO_PROCESS, os.getppid(), 15),\n"
        "             lambda: os.setpriority(os.PRIO_USER, os.getuid(), 15),\n"
        "             lambda: os.sched_setaffinity(os.getppid(), {min(os.sched_getaffinity(0))}),\n"
        "             lambda: os.sched_setscheduler(os.getppid(), os.SCHED_IDLE, os.sched_param(0))):\n"
        "    try:\n        call()\n    except OSError as e:\n        print('refused', e)\n"
    ),
    "fork server OOM score": (
        "import os\n"
        "try:\n    open(f'/proc/{os.getppid()}/oom_score_adj', 'w').write('1000')\n"
        "except OSError as e:\n    print('refused', e)\n"
    ),
    "work dir mode and xattrs": (
        "import os\nos.chmod('/work', 0o700)\n"
        "try:\n    os.setxattr('/work', 'user.agentrl', b'A')\nexcept OSError as e:\n    print('refused', e)\n"
    ),
    "own environment, cwd, umask, signals": (
        "import os, signal\nos.environ['LEFT'] = 'A'\nos.putenv('LEFT2', 'A')\nos.chdir('/tmp')\nos.umask(0o077)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
    ),
}

#: Attach to the fork server and rewrite one object in its memory: the interned string "error" (the
#: same object in the server and in this forked child, at the same address; CPython 3.11 layout:
#: length at +16, characters at +48), which becomes "ok": the server then reports every later
#: failing request as passed.
PTRACE_POKE = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
pp = os.getppid()
if libc.ptrace(16, pp, None, None) == 0:  # PTRACE_ATTACH
    os.waitpid(pp, 0x40000000)
    addr = id("error")
    libc.ptrace(5, pp, addr + 16, 2)  # PTRACE_POKEDATA: length
    libc.ptrace(5, pp, addr + sys.getsizeof("") - 1, int.from_bytes(b"ok", "little"))  # characters
    print("detach", libc.ptrace(17, pp, None, None))
else:
    print("attach refused", ctypes.get_errno())
'''

#: A request that tries all of the above at once, plus the fork server itself: ptrace (a poke
#: into its memory), and forged reply frames written into the server's reply pipe (/proc/<ppid>/fd/4), which
#: on a reachable server become this request's result *and the next request's*.
EVERYTHING = "\n".join([
    *LEFTOVERS.values(),
    "import base64, json, os, struct",
    "def frame(text):",
    "    body = json.dumps({'status': 'ok', 'exit_code': 0, 'signal': 0, 'stdout': base64.b64encode(text).decode(),",
    "                       'stderr': '', 'stdout_truncated': False, 'stderr_truncated': False, 'wall': 0.0,",
    "                       'cpu': 0.0, 'files': {}}).encode()",
    "    return struct.pack('>I', len(body)) + body",
    "try:",
    "    with open(f'/proc/{os.getppid()}/fd/4', 'wb', buffering=0) as f:",
    "        f.write(frame(b'forged for me\\n') + frame(b'forged for the next request\\n'))",
    "except OSError as e:",
    "    print('refused', e)",
    PTRACE_POKE,
])


@dataclass
class Single:
    name: str
    sb: Any


@pytest_asyncio.fixture(loop_scope="module", params=BACKENDS)
async def single(request: pytest.FixtureRequest, backend_opener: Any) -> AsyncIterator[Single]:
    """A new backend with ONE warm worker, so consecutive requests share it (fork-server backends only)."""
    if request.param not in FORK_SERVER_BACKENDS:
        pytest.skip(f"{request.param} runs code on the service's own workers (no warm worker of ours)")
    async with backend_opener(request.param, request, pool_size=1) as sb:
        yield Single(request.param, sb)


async def probe_around(s: Single, hostile: str) -> tuple[ExecResult, ExecResult, ExecResult]:
    """The state probe, then ``hostile``, then the probe again, all on the same worker."""
    before = await s.sb.run(ExecRequest(code=STATE_PROBE))
    assert before.status == "ok" and before.stdout.startswith("known program\n"), before
    attack = await s.sb.run(ExecRequest(code=hostile))
    after = await s.sb.run(ExecRequest(code=STATE_PROBE))
    return before, attack, after


@pytest.mark.parametrize("leftover", list(LEFTOVERS))
async def test_nothing_left_for_the_next_request(single: Single, leftover: str,
                                                 hazard_table: dict[tuple[str, str], str]) -> None:
    """What a request changes (its own process, its worker, its fork server) is gone for the next one."""
    before, attack, after = await probe_around(single, LEFTOVERS[leftover])
    hazard_table[(single.name, leftover)] = attack.status
    assert attack.status in ("ok", "error"), attack
    assert (after.status, after.stdout) == (before.status, before.stdout), (attack, after.stdout)
    hazard_table[(single.name, leftover)] = f"{attack.status} ✓"


async def test_hostile_request_cannot_change_the_next_result(
    single: Single, hazard_table: dict[tuple[str, str], str]
) -> None:
    """A request that tries everything at once (ptrace, forged replies, leftovers) changes nothing after it."""
    before, attack, after = await probe_around(single, EVERYTHING)
    hazard_table[(single.name, "next request after a hostile one")] = attack.status
    assert "forged" not in attack.stdout, attack
    assert (after.status, after.stdout) == (before.status, before.stdout), (attack, after)
    again = await single.sb.run(ExecRequest(code="print('known', 6 * 7)"))
    assert (again.status, again.stdout) == ("ok", "known 42\n"), again
    failing = await single.sb.run(ExecRequest(code="raise SystemExit(3)"))
    assert (failing.status, failing.exit_code) == ("error", 3), failing
    hazard_table[(single.name, "next request after a hostile one")] = f"{attack.status} ✓"
