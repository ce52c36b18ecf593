"""The exec server that runs *inside* a workspace (stdlib only; run as ``python3 -I -S``).

One server per workspace, alive as long as the workspace: it reads length-prefixed
JSON requests on fd 0 and answers on fd 1. Unlike the fork server of one-shot
requests (:mod:`agentrl.sandboxes._forkserver`) it never kills what a command
left behind nor wipes anything: files and background processes persist between
calls, which is the point of a workspace. Isolation *between* workspaces is the
host's job (one bwrap with its own namespaces, or one container, per workspace).

Ops: ``exec`` (``bash -c CMD`` in the work dir, stdin, wall timeout that kills
the command's process group, stdout/stderr capped, exit code), ``write`` and
``read`` (paths inside the workspace's writable roots only: a path that
resolves, through any symlink, outside them, or a FIFO/directory/missing file,
is refused; the same rule as ``fetch_files`` of one-shot requests).

Each command runs under the same guard as one-shot requests (the server is not
dumpable; the command is under a seccomp filter refusing ptrace and signals
aimed at the server), so a command cannot tamper with the answers of later
calls, e.g. the tests' verdict.

argv: MODE WORKDIR ROOT [ROOT ...]   MODE: ``ns`` (PID 1 of its own PID namespace:
reaps orphans) or ``once`` (serve one request and exit: a ``docker exec``).
The local backend runs :func:`main` from a precompiled copy (``-c``, see
agentrl.sandboxes.local_workspace); its imports are kept light (no json, re,
enum, selectors, contextlib: see :mod:`agentrl.sandboxes._forkserver`), as a
workspace pays them at every start.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import stat
import sys
import time

try:
    import _signal as signal  # see _forkserver: `signal` itself imports enum
except ImportError:  # pragma: no cover (not CPython)
    import signal  # type: ignore[no-redef]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _forkserver import Guard, _read_inside, _recv, _send, b64decode, b64encode, suppress  # noqa: E402


def inside(roots: list[str], path: str, workdir: str) -> tuple[str, str] | None:
    """(root, path relative to it) for ``path`` (absolute, or relative to ``workdir``) if it lies in a root."""
    full = os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))
    for root in roots:
        if full == root or full.startswith(root.rstrip("/") + "/"):
            return root, os.path.relpath(full, root)
    return None


class WorkspaceServer:
    def __init__(self, mode: str, workdir: str, roots: list[str]) -> None:
        self.mode = mode
        self.workdir = workdir
        self.roots = [os.path.normpath(r) for r in roots]
        self.pid = os.getpid()
        self.rfd, self.wfd = os.dup(0), os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        parent = os.getppid()
        self.guard = Guard([self.pid, *([parent] if parent > 1 else [])], [os.getpgid(0)])
        self.inherited_signals = [s for s in signal.valid_signals()
                                  if s not in (signal.SIGKILL, signal.SIGSTOP)
                                  and signal.getsignal(s) != signal.SIG_DFL]

    def reap(self, want: int = 0) -> int | None:
        """Reap finished children (orphans too, as PID 1); the wait status of ``want`` if it ended."""
        status = None
        while True:
            try:
                pid, st = os.waitpid(-1 if self.mode == "ns" else want or -1, os.WNOHANG)
            except ChildProcessError:
                return status
            if pid == 0:
                return status
            if pid == want:
                status = st

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "exec":
            return self.exec(req)
        if op == "write":
            return self.write(req)
        if op == "read":
            return self.read(req)
        if op == "ping":
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def _place(self, path: str) -> tuple[str, str] | dict[str, Any]:
        where = inside(self.roots, path, self.workdir)
        if where is None:
            return {"error": f"{path!r} is outside the workspace's writable dirs {self.roots}"}
        return where

    def write(self, req: dict[str, Any]) -> dict[str, Any]:
        where = self._place(req["path"])
        if isinstance(where, dict):
            return where
        root, rel = where
        real_root = os.path.realpath(root)
        full = os.path.join(root, rel)
        parent = os.path.realpath(os.path.dirname(full))
        if os.path.commonpath([real_root, parent]) != real_root:
            return {"error": f"{req['path']!r} resolves outside the workspace"}
        os.makedirs(parent, exist_ok=True)
        target = os.path.join(parent, os.path.basename(full))
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         req.get("mode", 0o644))
        except OSError as e:
            return {"error": f"cannot write {req['path']!r}: {e.strerror}"}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"error": f"{req['path']!r} is not a regular file"}
            view = memoryview(b64decode(req["data"]))
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, req.get("mode", 0o644))
        except OSError as e:
            return {"error": f"cannot write {req['path']!r}: {e.strerror}"}
        finally:
            os.close(fd)
        return {"ok": True}

    def read(self, req: dict[str, Any]) -> dict[str, Any]:
        where = self._place(req["path"])
        if isinstance(where, dict):
            return where
        data = _read_inside(where[0], where[1], int(req.get("max", 1 << 20)) + 1)
        if data is None:
            return {"error": f"{req['path']!r}: no regular file inside the workspace"}
        cap = int(req.get("max", 1 << 20))
        return {"data": b64encode(data[:cap]), "truncated": len(data) > cap}

    def exec(self, req: dict[str, Any]) -> dict[str, Any]:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                self._child(req, r_in, w_out, w_err)
            finally:
                os._exit(127)
        for fd in (r_in, w_out, w_err):
            os.close(fd)
        return self._supervise(req, pid, t0, r_out, r_err, w_in)

    def _child(self, req: dict[str, Any], r_in: int, w_out: int, w_err: int) -> None:
        os.setsid()
        os.dup2(r_in, 0)
        os.dup2(w_out, 1)
        os.dup2(w_err, 2)
        os.closerange(3, 65536)
        for s in self.inherited_signals:
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.umask(0o022)
        self.guard.confine()  # dumpable again: its own /proc files are its own
        with suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # a memory bomb is the OOM killer's victim, never the server (raising needs no privilege)
        limits = [(resource.RLIMIT_CORE, (0, 0))]
        if req.get("mem"):
            limits.append((resource.RLIMIT_AS, (req["mem"], req["mem"])))
        if req.get("max_file"):
            limits.append((resource.RLIMIT_FSIZE, (req["max_file"], req["max_file"])))
        for kind, value in limits:
            with suppress(ValueError, OSError):
                resource.setrlimit(kind, value)
        with suppress(OSError):
            os.chdir(req.get("cwd") or self.workdir)
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        try:
            os.execve(shell, [shell, "-c", req["cmd"]], req["env"])
        except OSError as e:
            os.write(2, f"cannot execute {shell}: {e.strerror}\n".encode())
            os._exit(126 if e.errno != errno.ENOENT else 127)

    def _supervise(self, req: dict[str, Any], pid: int, t0: float, r_out: int, r_err: int,
                   w_in: int) -> dict[str, Any]:
        cap = int(req["max_out"])
        bufs = {r_out: bytearray(), r_err: bytearray()}
        cut = {r_out: False, r_err: False}
        stdin = memoryview(b64decode(req.get("stdin", "")))
        poll = select.poll()
        for fd in (r_out, r_err):
            os.set_blocking(fd, False)
            poll.register(fd, select.POLLIN)
        readers = {r_out, r_err}
        if stdin:
            os.set_blocking(w_in, False)
            poll.register(w_in, select.POLLOUT)
        else:
            os.close(w_in)
            w_in = -1
        try:  # readable when the command exits: no polling, and no wait once its pipes are closed
            pidfd = os.pidfd_open(pid)
            poll.register(pidfd, select.POLLIN)
        except (AttributeError, OSError):
            pidfd = -1
        deadline = t0 + float(req["timeout"])
        status = None
        timed_out = False
        drain_until = None  # after the command exits: read what is buffered, never wait on a background writer
        while True:
            now = time.monotonic()
            if status is None:
                status = self.reap(pid)
                if status is not None:
                    drain_until = now + 0.05
            if status is None and now >= deadline:
                timed_out = True
                with suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                drain_until = time.monotonic() + 0.05
            if drain_until is not None and (time.monotonic() >= drain_until or not readers):
                break
            if drain_until is not None:
                limit = drain_until - time.monotonic()
            elif pidfd >= 0:
                limit = deadline - time.monotonic()
            else:  # no pidfd (old kernel): poll for the exit
                limit = min(deadline - time.monotonic(), 0.05 if readers else 0.002)
            for fd, _ in poll.poll(max(0.0, limit) * 1000):
                if fd == pidfd:
                    poll.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = -1
                    if status is None:
                        status = self.reap(pid)
                        if status is not None:
                            drain_until = time.monotonic() + 0.05
                    continue
                if fd == w_in:
                    try:
                        stdin = stdin[os.write(w_in, stdin[:65536]):]
                    except OSError:
                        stdin = memoryview(b"")
                    if not stdin:
                        poll.unregister(w_in)
                        os.close(w_in)
                        w_in = -1
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    poll.unregister(fd)
                    readers.discard(fd)
                    continue
                room = cap + 1 - len(bufs[fd])
                if room > 0:
                    bufs[fd] += chunk[:room]
                if len(chunk) > room:
                    cut[fd] = True
        for fd in (r_out, r_err, w_in, pidfd):
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        return {
            "exit_code": code,
            "timed_out": timed_out,
            "stdout": b64encode(bytes(bufs[r_out][:cap])),
            "stderr": b64encode(bytes(bufs[r_err][:cap])),
            "stdout_truncated": cut[r_out] or len(bufs[r_out]) > cap,
            "stderr_truncated": cut[r_err] or len(bufs[r_err]) > cap,
            "wall": time.monotonic() - t0,
        }

    def serve(self) -> None:
        _send(self.wfd, {"ready": True, "pid": self.pid})
        while True:
            req = _recv(self.rfd)
            if req is None:
                return
            try:
                res = self.handle(req)
            except Exception as e:
                res = {"error": f"workspace server: {type(e).__name__}: {e}", "internal": True}
            self.reap()
            _send(self.wfd, res)
            if self.mode == "once":
                return


def main(argv: list[str]) -> None:
    """``MODE WORKDIR ROOT [ROOT ...]`` (the module docstring)."""
    if argv[0] == "ns":
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
    WorkspaceServer(argv[0], argv[1], argv[2:]).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
