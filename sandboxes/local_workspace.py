"""Workspaces on the ``local`` backend: one long-lived bwrap per workspace, its state on overlayfs.

Each workspace is one process chain started from the host:
``unshare -m`` (``-rm`` when not root) runs a tiny shell that joins the
workspace's cgroups and mounts, in that private mount namespace only, a tmpfs
of ``disk_mb`` (the upper layer) and an overlayfs over the lower layers (the
workspace's writable dirs, made empty on the host, under a prepared state if
any), then execs ``bwrap`` (everything unshared, as in one-shot requests) with
the merged view's dirs bound at the workspace's writable dirs. Inside,
:mod:`agentrl.sandboxes._wsserver` is PID 1 and serves exec/read/write.

What a start costs, and what keeps it low (docs/terminal.md, "Measured"): no
``preexec_fn`` (the host spawns with vfork, which does not copy a large host
process's page tables, and runs no Python between fork and exec); the
writable dirs exist in the lower layer before the mount (no mkdir/chown per
dir inside); the server runs from bytecode compiled once per sandbox
(:func:`compile_servers`) and imports no json/re/enum (~23 ms of CPU less per
start than compiling and importing them).

Debian 12's bubblewrap 0.8 has no ``--overlay``; kernel overlayfs mounts fine
in a private mount namespace (as root, or in an unprivileged user namespace).
Mounts live only in that namespace: when the chain dies (closed, killed, or
its parent killed: ``--die-with-parent``) they go with it. On the host a
workspace has one temp dir ``agentrl-ws-<pid>-*`` (empty mount points, and a
prepared state's layer); dirs of dead pids are removed at the next start.

``prepare`` runs the set-up in a workspace whose upper layer is a host dir,
closes it, and keeps that dir: forks mount it as their lower layer and get a
private tmpfs upper, so a fork is copy-on-write and starts without set-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workspace import PreparedState, Workspace, WorkspaceError, WorkspaceSpec

if TYPE_CHECKING:
    from .local import LocalConfig

log = logging.getLogger(__name__)
_HDR = struct.Struct(">I")
_ids = itertools.count()
PREFIX = "agentrl-ws-"
SERVER_FILES = ("_wsserver.py", "_forkserver.py")
#: where the server dir is bound inside a workspace, and how the server starts there (from its bytecode)
SERVER_MOUNT = "/.agentrl"
_SERVER_MAIN = f"import sys; sys.path.insert(0, {SERVER_MOUNT!r}); import _wsserver; _wsserver.main(sys.argv[1:])"

# $1..$4: the workspace's host dir, lowerdir, upperdir, workdir; $5: tmpfs size (MB; 0: none); then the
# cgroup.procs files to join, "--", and the command. A first move into a cgroup waits for an
# RCU grace period (~10 ms): a background subshell moves this shell ($$) while it mounts, and `wait` holds
# the exec of the sandbox until it is in. (What the shell forks before the move, mount and mkdir, stays
# outside; the sandbox is started after it.)
_MOUNT_SH = r"""set -e
D=$1; LOWER=$2; UP=$3; WK=$4; DISK=$5; shift 5
(while [ "$1" != -- ]; do echo $$ 2>/dev/null > "$1" || true; shift; done) &
while [ "$1" != -- ]; do shift; done; shift
if [ "$DISK" != 0 ]; then mount -t tmpfs -o "size=${DISK}m,mode=0755" tmpfs "$D/mnt"; fi
mkdir -p "$UP" "$WK"
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$UP,workdir=$WK" "$D/merged"
wait
exec "$@"
"""

_compiled: set[tuple[str, str]] = set()
_compile_lock = threading.Lock()


def compile_servers(server_dir: Path, python: str, timeout_s: float = 60.0) -> bool:
    """Compile the server files in ``server_dir`` to ``__pycache__`` with the sandbox's interpreter (once).

    Inside a workspace the dir is read-only, so without this every start compiles both files again.
    False (and the sources are used) where the interpreter cannot compile them."""
    key = (str(server_dir), python)
    with _compile_lock:
        if key in _compiled:
            return True
        code = "import py_compile, sys\nfor f in sys.argv[1:]: py_compile.compile(f, doraise=True)"
        try:
            subprocess.run([python, "-I", "-S", "-c", code, *(str(server_dir / f) for f in SERVER_FILES)],
                           check=True, capture_output=True, timeout=timeout_s, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("could not precompile the workspace server with %s (%s): starts compile it each time",
                        python, e)
            return False
        for pyc in (server_dir / "__pycache__").glob("*.pyc"):
            pyc.chmod(0o644)
        (server_dir / "__pycache__").chmod(0o755)
        _compiled.add(key)
        return True


def forget_compiled(server_dir: Path) -> None:
    """The sandbox that owned ``server_dir`` closed (its dir is removed)."""
    with _compile_lock:
        for key in [k for k in _compiled if k[0] == str(server_dir)]:
            _compiled.discard(key)


def reap_stale_dirs(tmp: Path | None = None) -> None:
    """Remove workspace temp dirs left by dead processes (a killed run)."""
    base = tmp or Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for d in base.glob(PREFIX + "*-*"):
            pid = d.name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(d, ignore_errors=True)


def leftover_dirs(tmp: Path | None = None) -> list[Path]:
    """This process's workspace temp dirs (for leak checks)."""
    base = tmp or Path(tempfile.gettempdir())
    return sorted(base.glob(f"{PREFIX}{os.getpid()}-*"))


class LocalPrepared(PreparedState):
    """A prepared state on local: a host dir holding the set-up's overlay layer."""

    def __init__(self, spec: WorkspaceSpec, setup_s: float, home: Path, layer: Path) -> None:
        super().__init__(spec, setup_s)
        self.home, self.layer = home, layer

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(shutil.rmtree, self.home, True)


class LocalWorkspace(Workspace):
    """One workspace in its own bwrap (see the module docstring)."""

    def __init__(self, config: LocalConfig, server_dir: Path, spec: WorkspaceSpec,
                 prepared: PreparedState | None = None, *, keep_layer: bool = False) -> None:
        if prepared is not None and not isinstance(prepared, LocalPrepared):
            raise WorkspaceError(f"a {type(prepared).__name__} cannot be forked on the local backend")
        super().__init__(spec, prepared)
        self.config = config
        self.server_dir = server_dir
        self.keep_layer = keep_layer  # prepare(): the upper layer is a host dir that outlives the workspace
        self.backstop_s = config.backstop_s
        self.proc: asyncio.subprocess.Process | None = None
        self.home: Path | None = None
        from .local import Cgroups

        self.cgroups = Cgroups(f"agentrl-sbx-{os.getpid()}-ws{next(_ids)}" if config.cgroups == "auto" else None)

    def argv(self, home: Path) -> list[str]:
        c, spec = self.config, self.spec
        as_root = os.geteuid() == 0
        if spec.network and not c.allow_network:
            raise WorkspaceError("the workspace asks for network but this local sandbox has allow_network: false")
        lower = (f"{self.prepared.layer}:{home / 'empty'}" if isinstance(self.prepared, LocalPrepared)
                 else str(home / "empty"))
        if self.keep_layer:
            up, wk, disk = home / "layer", home / "work", 0
        else:
            up, wk, disk = home / "mnt" / "up", home / "mnt" / "wk", spec.disk_mb
        roots = spec.roots()
        unshare = ["unshare", "-m", "--propagation", "private"] if as_root else ["unshare", "-rm", "--propagation",
                                                                                 "private"]
        drop = (["setpriv", f"--reuid={c.uid}", f"--regid={c.gid}", "--clear-groups"] if as_root else [])
        bw = [
            c.bwrap, "--unshare-all", *(["--share-net"] if spec.network else []),
            "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv",
            "--uid", str(c.uid), "--gid", str(c.gid), "--hostname", "workspace",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
            "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
            "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(spec.disk_mb << 20), "--tmpfs", "/tmp",
            "--size", str(min(spec.disk_mb, 64) << 20), "--tmpfs", "/dev/shm",
            "--mqueue", "/dev/mqueue", "--remount-ro", "/dev",
        ]
        bw += ["--ro-bind", str(self.server_dir), SERVER_MOUNT]
        for r in roots:
            bw += ["--bind", f"{home}/merged{r}", r]
        if spec.network:
            bw += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf", "--ro-bind-try", "/etc/hosts", "/etc/hosts"]
        for path in c.ro_binds:
            bw += ["--ro-bind", path, path]
        bw += ["--remount-ro", "/", "--chdir", spec.workdir,
               c.python, "-I", "-S", "-c", _SERVER_MAIN, "ns", spec.workdir, *roots]
        return [*unshare, "sh", "-c", _MOUNT_SH, "sh", str(home), lower, str(up), str(wk), str(disk),
                *self.cgroups.procs_files, "--", *drop, *bw]

    def make_roots(self, home: Path) -> None:
        """The writable dirs, empty, in the lowest layer (owned by the sandbox user): the overlay shows them."""
        c = self.config
        for r in self.spec.roots():
            d = home / "empty" / r.lstrip("/")
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            d.chmod(0o755)
            if os.geteuid() == 0:
                os.chown(d, c.uid, c.gid)

    async def _start(self) -> None:
        if (str(self.server_dir), self.config.python) not in _compiled:
            async with asyncio.timeout(self.config.startup_timeout_s + 60):
                await asyncio.to_thread(compile_servers, self.server_dir, self.config.python)
        reap_stale_dirs()
        self.home = home = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        for d in ("empty", "mnt", "merged"):
            (home / d).mkdir()
        home.chmod(0o755)
        self.make_roots(home)
        # tmpfs pages count as memory: room for a full disk, so filling it gives ENOSPC, not an OOM kill
        self.cgroups.set_limits((self.spec.memory_mb + self.spec.disk_mb) << 20, self.spec.max_processes)
        # no preexec_fn: vfork, and the chain's shell joins the cgroups before anything forks
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(home), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, start_new_session=True,
        )
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                hello = await self._recv()
            if not hello.get("ready"):
                raise RuntimeError(f"unexpected hello {hello!r}")
        except Exception as e:
            err = b""
            self._kill_now()
            with contextlib.suppress(Exception):
                assert self.proc.stderr is not None
                err = await asyncio.wait_for(self.proc.stderr.read(4000), 2)
            raise WorkspaceError(f"the local workspace failed to start ({type(e).__name__}: {e}): "
                                 f"{err.decode(errors='replace')}") from e

    async def _recv(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        n = _HDR.unpack(await self.proc.stdout.readexactly(4))[0]
        reply: dict[str, Any] = json.loads(await self.proc.stdout.readexactly(n))
        return reply

    async def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        if self.proc.returncode is not None:
            raise WorkspaceError(f"the workspace process exited ({self.proc.returncode})")
        data = json.dumps(msg).encode()
        async with asyncio.timeout(timeout_s + self.backstop_s):
            self.proc.stdin.write(_HDR.pack(len(data)) + data)
            await self.proc.stdin.drain()
            return await self._recv()

    def _kill_now(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the chain's leader heads its own group; Popen.kill would poll and
                # reap it under asyncio's child watcher ("Unknown child process", returncode 255)

    async def _teardown(self) -> None:
        try:
            if self.proc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.proc.wait(), 5.0)
        finally:
            self.cgroups.remove()
            if self.home is not None and not self.keep_layer:
                shutil.rmtree(self.home, ignore_errors=True)

    def pid(self) -> int | None:
        """The host pid of the workspace's process chain (tests)."""
        return None if self.proc is None else self.proc.pid


async def prepare_local(config: LocalConfig, server_dir: Path, spec: WorkspaceSpec) -> LocalPrepared:
    """Run ``spec``'s set-up once in a workspace whose upper layer is kept; forks mount it read-only."""
    t0 = time.perf_counter()
    ws = LocalWorkspace(config, server_dir, spec, keep_layer=True)
    try:
        async with ws:
            pass
    except BaseException:
        if ws.home is not None:
            shutil.rmtree(ws.home, ignore_errors=True)
        raise
    assert ws.home is not None
    for d in ("work", "mnt", "merged", "empty"):
        shutil.rmtree(ws.home / d, ignore_errors=True)
    return LocalPrepared(spec, time.perf_counter() - t0, ws.home, ws.home / "layer")
