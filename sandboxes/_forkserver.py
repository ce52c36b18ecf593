"""The fork server that runs *inside* a sandbox (stdlib only; run as ``python3 -I -S``).

It reads length-prefixed JSON requests on fd 0 and answers on fd 1. For each
request it forks one fresh child that runs the code (Python in the forked,
already-warm interpreter; anything else through exec), enforces the wall
timeout and output caps, then kills every other process in the sandbox and
wipes the writable directories, so nothing written by one request (files,
globals, environment, processes) is visible to the next.

Mode ``ns``: the server is PID 1 of its own PID namespace (bwrap
``--as-pid-1``). Code can neither signal it (the kernel drops signals to a
namespace's init that it has no handler for) nor hide from it:
``kill(-1, SIGKILL)`` reaches every process in the namespace.
Mode ``tree``: not PID 1 (``unsafe_local``, or a docker exec next to the
container's init); the server becomes a child subreaper, so orphans are
re-parented to it, and kills all its descendants.

argv: MODE WORKDIR [SCRATCH_DIR ...]
"""

from __future__ import annotations

import base64
import contextlib
import errno
import gc
import json
import os
import resource
import selectors
import signal
import struct
import sys
import time
import types

if False:  # typing only (typing, shutil, traceback... are left out: a smaller heap forks faster)
    from typing import Any

_HDR = struct.Struct(">I")


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _send(fd: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(_HDR.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int) -> dict[str, Any] | None:
    hdr = _read_exact(fd, 4)
    if hdr is None:
        return None
    body = _read_exact(fd, _HDR.unpack(hdr)[0])
    return None if body is None else json.loads(body)


def _out_of_memory(stderr: bytes) -> bool:
    """Python's MemoryError, or a C program's failed allocation (bash: "xmalloc: cannot allocate", errno ENOMEM)."""
    tail = stderr[-400:].rstrip()
    return tail.endswith(b"MemoryError") or b"cannot allocate" in tail.lower()


def _empty_dir(path: str) -> None:
    """Remove everything inside ``path`` (making directories writable first if needed)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.chmod(e.path, 0o700)
                _empty_dir(e.path)
                os.rmdir(e.path)
            else:
                os.unlink(e.path)
        except OSError:
            pass


class Server:
    def __init__(self, mode: str, workdir: str, scratch: list[str]) -> None:
        self.mode = mode
        self.workdir = workdir
        self.scratch = [workdir, *scratch]
        self.pid = os.getpid()
        # Keep the protocol off fds 0/1 so children never inherit it.
        self.rfd = os.dup(0)
        self.wfd = os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        if mode == "tree":
            import ctypes

            with contextlib.suppress(Exception):
                ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

    # -- process cleanup ---------------------------------------------------
    def _descendants(self) -> list[int]:
        parents: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        stat = f.read()
                    parents[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
                except (OSError, ValueError):
                    continue
        found, frontier = set(), {self.pid}
        while frontier:
            frontier = {p for p, pp in parents.items() if pp in frontier and p not in found}
            found |= frontier
        return sorted(found)

    def kill_all(self) -> None:
        """Kill every process the request left behind, then reap them all."""
        for _ in range(1000):
            if self.mode == "ns":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
            else:
                for p in self._descendants():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p, signal.SIGKILL)
            try:
                while True:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
            except ChildProcessError:
                return  # nothing left at all
            time.sleep(0.001)

    def wipe(self) -> None:
        """Empty every writable directory (raises if something cannot be removed)."""
        for d in self.scratch:
            _empty_dir(d)
            if os.listdir(d):
                raise RuntimeError(f"could not wipe {d}")

    # -- one request ---------------------------------------------------------
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        for name, b64 in req["files"].items():
            path = os.path.join(self.workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(b64))
        compiled: types.CodeType | BaseException | None = None
        if req["argv"] is None and req["language"] == "python":
            try:  # bounded work: CPython's optimizer caps constant folding
                src = req["files"][req["main"]]
                compiled = compile(base64.b64decode(src), req["main"], "exec", dont_inherit=True)
            except Exception as e:  # SyntaxError, ValueError (NUL bytes), MemoryError, RecursionError
                compiled = e
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        r_in, w_in = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r_out)
                os.close(r_err)
                os.close(w_in)
                self._child(req, r_in, w_out, w_err, compiled)
            finally:
                os._exit(127)
        os.close(w_out)
        os.close(w_err)
        os.close(r_in)
        res = self._supervise(req, pid, t0, r_out, r_err, w_in)
        res["files"] = {}
        for name in req["fetch_files"]:
            try:
                with open(os.path.join(self.workdir, name), "rb") as f:
                    res["files"][name] = base64.b64encode(f.read(req["max_file"] + 1)[: req["max_file"]]).decode()
            except OSError:
                pass
        return res

    def _supervise(self, req: dict[str, Any], pid: int, t0: float, r_out: int, r_err: int, w_in: int) -> dict[str, Any]:
        deadline = t0 + req["wall"]
        limit = req["max_out"]
        bufs = {r_out: bytearray(), r_err: bytearray()}
        truncated = {r_out: False, r_err: False}
        stdin = memoryview(base64.b64decode(req["stdin"]))
        sel = selectors.DefaultSelector()
        for fd in (r_out, r_err):
            sel.register(fd, selectors.EVENT_READ)
        if stdin:
            os.set_blocking(w_in, False)
            sel.register(w_in, selectors.EVENT_WRITE)
        else:
            os.close(w_in)
        try:
            pidfd = os.pidfd_open(pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = -1
        killed_by_us = None
        exited = False
        exited_at: float | None = None
        open_streams = 2
        while open_streams and not killed_by_us:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_by_us = "timeout"
                break
            if exited:  # main process is gone: whatever still holds the pipes is left over
                remaining = min(remaining, 0.02)
            events = sel.select(remaining if pidfd >= 0 else min(remaining, 0.01))
            if not events and exited:
                break
            for key, _ in events:
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    exited = True
                elif fd == w_in:
                    try:
                        n = os.write(w_in, stdin[:65536])
                        stdin = stdin[n:]
                    except OSError:
                        stdin = stdin[:0]
                    if not stdin:
                        sel.unregister(w_in)
                        os.close(w_in)
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        sel.unregister(fd)
                        open_streams -= 1
                        continue
                    buf = bufs[fd]
                    buf += chunk
                    if len(buf) > limit:
                        del buf[limit:]
                        truncated[fd] = True
                        killed_by_us = "output_limit"
            if pidfd < 0 and not exited:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if exited and exited_at is None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() - exited_at > 0.05:
                break  # leftovers still writing: they are killed below
        self.kill_all_but(pid)
        _, wstatus, ru = os.wait4(pid, 0)
        self.kill_all()
        sel.close()
        for fd in (r_out, r_err, w_in, pidfd):
            with contextlib.suppress(OSError):
                if fd >= 0:
                    os.close(fd)
        wall = time.monotonic() - t0
        exit_code = os.waitstatus_to_exitcode(wstatus)
        sig = -exit_code if exit_code < 0 else 0
        stderr = bytes(bufs[r_err])
        if killed_by_us:
            status = killed_by_us
        elif sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and ru.ru_utime + ru.ru_stime >= req["cpu"]):
            status = "timeout"
        elif sig == signal.SIGKILL or (exit_code != 0 and _out_of_memory(stderr)):
            status = "oom"
        elif exit_code != 0:
            status = "error"
        else:
            status = "ok"
        return {
            "status": status,
            "exit_code": exit_code,
            "signal": sig,
            "stdout": base64.b64encode(bytes(bufs[r_out])).decode(),
            "stderr": base64.b64encode(stderr).decode(),
            "stdout_truncated": truncated[r_out],
            "stderr_truncated": truncated[r_err],
            "wall": wall,
            "cpu": ru.ru_utime + ru.ru_stime,
        }

    def kill_all_but(self, pid: int) -> None:
        """Stop the whole request tree now (timeouts, floods, leftover orphans)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the child's session/group first: atomic against fork bombs
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if self.mode == "ns":
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        else:
            for p in self._descendants():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)

    def _child(self, req: dict[str, Any], r_in: int, w_out: int, w_err: int,
               compiled: types.CodeType | BaseException | None) -> None:
        os.setsid()
        os.dup2(r_in, 0)
        os.dup2(w_out, 1)
        os.dup2(w_err, 2)
        os.closerange(3, 65536)
        for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        cpu = max(1, int(req["cpu"] + 0.999))
        limits = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_FSIZE, (req["max_file"], req["max_file"])),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if req["mem"]:
            limits.append((resource.RLIMIT_AS, (req["mem"], req["mem"])))
        if req["nproc"]:
            limits.append((resource.RLIMIT_NPROC, (req["nproc"], req["nproc"])))
        for kind, value in limits:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(kind, value)
        os.chdir(self.workdir)
        os.environ.clear()
        os.environ.update(req["env"])
        if compiled is not None:
            self._exec_python(req["main"], compiled)
        argv = req["argv"] or ["bash", req["main"]]
        try:
            os.execvpe(argv[0], argv, req["env"])
        except OSError as e:
            os.write(2, f"cannot execute {argv[0]!r}: {e.strerror}\n".encode())
            os._exit(126 if e.errno != errno.ENOENT else 127)

    def _exec_python(self, main: str, compiled: types.CodeType | BaseException) -> None:
        """Run main.py in this (forked, warm) interpreter as ``python main.py`` would.

        ``compiled`` was compiled by the server before the fork: compiling in the
        child would copy-on-write much of the heap (page faults dominate here).
        A compile error is raised here so it is reported like Python does.
        """
        code = 0
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets them at startup
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if isinstance(compiled, BaseException):
                raise compiled
            module = types.ModuleType("__main__")
            module.__file__ = os.path.join(self.workdir, main)
            sys.modules["__main__"] = module
            sys.argv = [main]
            sys.path.insert(0, self.workdir)
            exec(compiled, module.__dict__)
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code & 0xFF
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except MemoryError:
            with contextlib.suppress(BaseException):
                os.write(2, b"MemoryError\n")
            os._exit(1)
        except BaseException as e:
            with contextlib.suppress(BaseException):  # hide this server's own frame
                import traceback

                traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                code = code or 120
        os._exit(code)

    def serve(self) -> None:
        gc.collect()
        gc.freeze()  # forked children then do not copy-on-write the whole heap when they collect
        _send(self.wfd, {"ready": True, "pid": self.pid})
        while True:
            req = _recv(self.rfd)
            if req is None:
                return
            try:
                res = self.handle(req)
            except Exception as e:
                res = {"status": "sandbox_error", "message": f"fork server: {type(e).__name__}: {e}"}
            try:
                self.kill_all()
                self.wipe()
            except Exception as e:
                res["dirty"] = f"{type(e).__name__}: {e}"
            _send(self.wfd, res)
            if "dirty" in res:
                return


if __name__ == "__main__":
    if sys.argv[1] == "ns":
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)  # as PID 1, default-disposition signals are dropped
    Server(sys.argv[1], sys.argv[2], sys.argv[3:]).serve()
