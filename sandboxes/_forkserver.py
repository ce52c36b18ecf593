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
Mode ``tree``: not PID 1 (a docker exec next to the container's init); the
server becomes a child subreaper, so orphans are re-parented to it, and kills
all its descendants. Mode ``host``: as ``tree``, on the host's shared
namespaces (``unsafe_local``), so SysV IPC objects are not swept.

The server is out of its children's reach (see :class:`Guard`): it is not
dumpable (no ptrace, no /proc/<pid>/mem, environ, fd/* for a process without
CAP_SYS_PTRACE), and every child runs under a seccomp filter that refuses
ptrace-like calls, keyrings, and signals/rlimits/priorities aimed at the
server. After each request it also sweeps what a request could leave in the
worker (SysV IPC objects, POSIX message queues, the scratch dirs' mode and
xattrs) and checks its own rlimits, priority, CPUs and OOM score: changed
means ``dirty`` (the host replaces the worker).

argv: MODE WORKDIR [SCRATCH_DIR ...]  (scratch dirs that do not exist are skipped)
"""

from __future__ import annotations

import binascii
import errno
import gc
import os
import resource
import stat
import struct
import sys
import time
import types

# Kept light on purpose: a workspace server imports this module at every workspace start, where
# json, base64, contextlib, selectors and signal would pull in re, enum, functools and collections
# (~15 ms of CPU per start). The C modules behind them (_json, _signal, binascii) do the same work.
try:
    import _signal as signal  # the functions and constants of `signal`, without its enum wrappers
except ImportError:  # pragma: no cover (not CPython)
    import signal  # type: ignore[no-redef]

TYPE_CHECKING = False  # mypy reads it as True; `typing` itself is not imported at run time

if TYPE_CHECKING:  # typing only (typing, shutil, traceback... are left out: a smaller heap forks faster)
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


class suppress:
    """As contextlib's ``suppress`` (contextlib is not imported: see the imports)."""

    def __init__(self, *excs: type[BaseException]) -> None:
        self.excs = excs

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, self.excs)


def b64encode(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode()


def b64decode(text: str | bytes) -> bytes:
    return binascii.a2b_base64(text)  # like the base64 module's: characters outside the alphabet are skipped


try:  # JSON through the json package's own C encoder and scanner, without the package (it imports re)
    from _json import encode_basestring_ascii as _quote
    from _json import make_encoder as _make_encoder
    from _json import make_scanner as _make_scanner

    def _no_default(obj: object) -> object:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    _encode = _make_encoder(None, _no_default, _quote, None, ": ", ", ", False, False, True)

    class _ScanContext:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__

    _scan = _make_scanner(_ScanContext())  # type: ignore[arg-type]  # any object with these attributes

    def json_dumps(obj: object) -> str:
        return "".join(_encode(obj, 0))

    def json_loads(data: bytes | str) -> Any:
        text = data.decode() if isinstance(data, bytes) else data
        start = len(text) - len(text.lstrip(" \t\n\r"))
        try:
            obj, end = _scan(text, start)
        except StopIteration as e:
            raise ValueError(f"invalid JSON at {e.value}") from None
        if text[end:].strip(" \t\n\r"):
            raise ValueError(f"extra data after the JSON value at {end}")
        return obj
except ImportError:  # pragma: no cover (not CPython)
    import json as _json_module

    def json_dumps(obj: object) -> str:
        return _json_module.dumps(obj)

    def json_loads(data: bytes | str) -> Any:
        return _json_module.loads(data)


def _send(fd: int, obj: dict[str, Any]) -> None:
    data = json_dumps(obj).encode()
    view = memoryview(_HDR.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int) -> dict[str, Any] | None:
    hdr = _read_exact(fd, 4)
    if hdr is None:
        return None
    body = _read_exact(fd, _HDR.unpack(hdr)[0])
    return None if body is None else json_loads(body)


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
                with suppress(OSError):
                    os.chmod(e.path, 0o700)
                _empty_dir(e.path)
                os.rmdir(e.path)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _read_inside(root: str, name: str, cap: int) -> bytes | None:
    """Up to ``cap`` bytes of the regular file ``root/name``; None if missing, not a regular file, or
    resolving (through any symlink) to a place outside ``root``. Called when no request process is
    left, so nothing can swap a link between the check and the open."""
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([real_root, path]) != real_root:
        return None
    try:  # O_NONBLOCK: a FIFO must not hang the server
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], cap
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


# seccomp: syscall numbers per architecture (AUDIT_ARCH value, numbers)
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
        "process_madvise": 440, "pidfd_send_signal": 424, "add_key": 248, "request_key": 249, "keyctl": 250,
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "pidfd_open": 434, "prlimit64": 302, "sched_setaffinity": 203, "sched_setscheduler": 144,
        "sched_setparam": 142, "sched_setattr": 314, "setpriority": 141, "ioprio_set": 251,
    }),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
        "process_madvise": 440, "pidfd_send_signal": 424, "add_key": 217, "request_key": 218, "keyctl": 219,
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "pidfd_open": 434, "prlimit64": 261, "sched_setaffinity": 122, "sched_setscheduler": 119,
        "sched_setparam": 118, "sched_setattr": 274, "setpriority": 140, "ioprio_set": 30,
    }),
}
#: refused whatever the arguments: reading/writing/comparing another process, signals through a pidfd
#: (an open /proc/<pid> directory is one, so the pid cannot be checked), and keyrings (a key added to the
#: session or user keyring outlives the request in a warm worker)
_DENY_ALWAYS = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
                "pidfd_send_signal", "add_key", "request_key", "keyctl")
#: refused when the target (first argument) is a protected pid
_DENY_FOR_PID = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open", "prlimit64",
                 "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr")
#: (which, who): refused for which == "every process of a user", or who == a protected pid/group
_DENY_FOR_WHO = {"setpriority": 2, "ioprio_set": 3}  # PRIO_USER, IOPRIO_WHO_USER
_X32_BIT = 0x40000000


def seccomp_filter(protected: list[int], groups: list[int], machine: str) -> bytes:
    """A classic-BPF seccomp program (``struct sock_filter[]``) for the children.

    Refuses (EPERM) the ``_DENY_ALWAYS`` calls; signals, pidfds, rlimits and scheduling aimed at a
    ``protected`` pid (the server, its parent); ``kill`` of everyone (-1) or of a protected process
    group; priority changes for a whole user; and any call of another ABI (x32, i386 through
    ``int 0x80``), which would otherwise bypass these numbers. Pid arguments are compared on their low
    32 bits, which is what the kernel reads (pid_t).
    """
    if machine not in _ARCHES:
        raise RuntimeError(f"no seccomp filter for architecture {machine!r} (supported: {sorted(_ARCHES)})")
    arch, nr = _ARCHES[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO(EPERM)
    arg = [16 + 8 * i for i in range(6)]  # seccomp_data.args[i] (low half, little endian)
    prog: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k); jumps are filled in relative
    deny_at: list[int] = []  # instructions whose true branch goes to the final deny

    def deny_if(code: int, k: int) -> None:
        deny_at.append(len(prog))
        prog.append((code, 0, 0, k))

    prog.append((ld, 0, 0, 4))  # arch
    prog.append((jeq, 1, 0, arch))
    prog.append((ret, 0, 0, deny))
    prog.append((ld, 0, 0, 0))  # nr
    if machine == "x86_64":
        deny_if(jge, _X32_BIT)
    for name in _DENY_ALWAYS:
        deny_if(jeq, nr[name])
    pids = [p & 0xFFFFFFFF for p in protected if p > 0]
    blocks: list[tuple[int, list[tuple[int, int]]]] = []  # (nr, [(arg offset, value)])
    for name in _DENY_FOR_PID:
        checks = [(arg[0], p) for p in pids]
        if name == "kill":
            checks += [(arg[0], 0xFFFFFFFF)] + [(arg[0], -g & 0xFFFFFFFF) for g in groups if g > 1]
        blocks.append((nr[name], checks))
    for name, whole_user in _DENY_FOR_WHO.items():
        blocks.append((nr[name], [(arg[0], whole_user)] + [(arg[1], p) for p in pids + [g for g in groups if g > 0]]))
    for number, checks in blocks:
        prog.append((ld, 0, 0, 0))  # nr (the accumulator holds an argument after a block)
        prog.append((jeq, 0, 2 * len(checks) + 1, number))  # not this call: skip the block
        for offset, value in checks:
            prog.append((ld, 0, 0, offset))
            deny_if(jeq, value)
        prog.append((ret, 0, 0, allow))
    prog.append((ret, 0, 0, allow))
    deny_pc = len(prog)
    prog.append((ret, 0, 0, deny))
    for i in deny_at:
        code, _, jf, k = prog[i]
        if deny_pc - i - 1 > 255:
            raise RuntimeError("seccomp filter too long for 8-bit jumps")
        prog[i] = (code, deny_pc - i - 1, jf, k)
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)


class Guard:
    """Keeps the server out of its children's reach and notices if anything reached it anyway.

    Three layers (docs/sandboxes.md, "Warm workers: one request cannot reach the next"):
    1. the server is not dumpable (``PR_SET_DUMPABLE 0``): ptrace and /proc/<pid>/{mem,environ,fd,
       maps,root,...} need CAP_SYS_PTRACE, which no child has; its /proc files belong to root;
    2. each child runs under :func:`seccomp_filter` (with ``no_new_privs``), which refuses ptrace-like
       calls outright and the pid-taking calls (signals, rlimits, priority, CPUs) aimed at the server;
    3. after each request :meth:`changed` compares the server's rlimits, priority, CPUs, scheduler and
       OOM score with those at start: any difference makes the worker dirty (replaced).
    """

    def __init__(self, protected: list[int], groups: list[int]) -> None:
        import ctypes  # the server pays this once; children reuse it (forked)

        self.libc = ctypes.CDLL(None, use_errno=True)
        if self.libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
        code = seccomp_filter(protected, groups, os.uname().machine)
        self._filter = ctypes.create_string_buffer(code, len(code))

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        self._fprog = SockFprog(len(code) // 8, ctypes.addressof(self._filter))
        self._fprog_ref = ctypes.byref(self._fprog)
        self.ipc_info = ctypes.create_string_buffer(64)  # struct shm_info / seminfo / msginfo
        self.start = self.snapshot()

    def confine(self) -> None:
        """In a fresh child: dumpable again (its own /proc is its own) and under the seccomp filter."""
        libc = self.libc
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1: only this child's own files; the server stays 0
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, self._fprog_ref, 0, 0) != 0:
            os.write(2, b"sandbox: cannot install the seccomp filter\n")  # PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP
            os._exit(125)

    def check_supported(self) -> None:
        """Fail at start (not per request) where the kernel cannot install the filter."""
        pid = os.fork()
        if pid == 0:
            try:
                self.confine()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError("the kernel refused the children's seccomp filter (CONFIG_SECCOMP_FILTER?)")

    @staticmethod
    def _read(path: str) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return b"?"
        try:
            return os.read(fd, 8192)
        finally:
            os.close(fd)

    @classmethod
    def snapshot(cls) -> tuple[object, ...]:
        """The server's own rlimits, priority, CPUs, scheduler and OOM score (cheap: ~10 syscalls)."""
        return (cls._read("/proc/self/limits"), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0),
                os.sched_getscheduler(0), cls._read("/proc/self/oom_score_adj"))

    def changed(self) -> str:
        """What differs from the start (empty: nothing). The filter should make this impossible."""
        now = self.snapshot()
        names = ("rlimits", "priority", "CPUs", "scheduler", "OOM score")
        return ", ".join(n for n, a, b in zip(names, self.start, now, strict=True) if a != b)


def sweep_sysv_ipc(libc: Any, info: Any) -> None:
    """Remove every SysV shared memory segment, semaphore set and message queue of this IPC namespace
    (a request's objects outlive it otherwise; only called where the namespace is the worker's own).

    Three ``*_INFO`` calls count them first (``info``: a 64-byte ctypes buffer), so the usual case,
    none, costs no /proc parsing."""
    counts = []
    for call, cmd, index in ((libc.shmctl, 14, 0), (libc.semctl, 19, 7), (libc.msgctl, 12, 0)):
        ctypes_args = (0, 0, cmd, info) if call is libc.semctl else (0, cmd, info)  # SHM/SEM/MSG_INFO
        if call(*ctypes_args) < 0:
            counts.append(1)  # cannot tell: look
        else:
            counts.append(struct.unpack_from("<10i", info.raw)[index])  # used_ids, semusz, msgpool
    for kind, count in zip(("shm", "sem", "msg"), counts, strict=True):
        if not count:
            continue
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ident = int(line.split()[1])
            if kind == "shm":
                rc = libc.shmctl(ident, 0, None)  # IPC_RMID = 0
            elif kind == "sem":
                rc = libc.semctl(ident, 0, 0)
            else:
                rc = libc.msgctl(ident, 0, None)
            if rc != 0:
                raise RuntimeError(f"could not remove SysV {kind} {ident}")


class Server:
    def __init__(self, mode: str, workdir: str, scratch: list[str]) -> None:
        self.mode = mode
        self.workdir = workdir
        self.scratch = [d for d in (workdir, *scratch) if os.path.isdir(d)]
        self.scratch_modes = {d: os.stat(d).st_mode & 0o7777 for d in self.scratch}
        self.pid = os.getpid()
        # Keep the protocol off fds 0/1 so children never inherit it.
        self.rfd = os.dup(0)
        self.wfd = os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        parent = os.getppid()
        self.guard = Guard([self.pid, *([parent] if parent > 1 else [])], [os.getpgid(0)])
        self.guard.check_supported()
        if mode in ("tree", "host"):
            self.guard.libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        # signals ignored or handled here would stay so in an exec'd child: reset them there
        self.inherited_signals = [s for s in signal.valid_signals()
                                  if s not in (signal.SIGKILL, signal.SIGSTOP)
                                  and signal.getsignal(s) != signal.SIG_DFL]

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
                with suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
            else:
                for p in self._descendants():
                    with suppress(ProcessLookupError, PermissionError):
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
        """Empty every writable directory and restore its mode and xattrs; sweep SysV IPC where the IPC
        namespace is the worker's own (raises if something cannot be removed)."""
        for d in self.scratch:
            _empty_dir(d)
            if os.listdir(d):
                raise RuntimeError(f"could not wipe {d}")
            if os.stat(d).st_mode & 0o7777 != self.scratch_modes[d]:
                os.chmod(d, self.scratch_modes[d])
            with suppress(OSError):  # ENOTSUP: no xattrs here
                for name in os.listxattr(d):
                    os.removexattr(d, name)
        if self.mode != "host":
            sweep_sysv_ipc(self.guard.libc, self.guard.ipc_info)

    # -- one request ---------------------------------------------------------
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        for name, b64 in req["files"].items():
            path = os.path.join(self.workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b64decode(b64))
        compiled: types.CodeType | BaseException | None = None
        if req["argv"] is None and req["language"] == "python":
            try:  # bounded work: CPython's optimizer caps constant folding
                src = req["files"][req["main"]]
                compiled = compile(b64decode(src), req["main"], "exec", dont_inherit=True)
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
        for name in req["fetch_files"]:  # every request process is gone by now
            data = _read_inside(self.workdir, name, req["max_file"])
            if data is not None:
                res["files"][name] = b64encode(data)
        return res

    def _supervise(self, req: dict[str, Any], pid: int, t0: float, r_out: int, r_err: int, w_in: int) -> dict[str, Any]:
        import selectors  # imported before the freeze in serve(); the workspace server never needs it

        deadline = t0 + req["wall"]
        limit = req["max_out"]
        bufs = {r_out: bytearray(), r_err: bytearray()}
        truncated = {r_out: False, r_err: False}
        stdin = memoryview(b64decode(req["stdin"]))
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
            with suppress(OSError):
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
            "stdout": b64encode(bytes(bufs[r_out])),
            "stderr": b64encode(stderr),
            "stdout_truncated": truncated[r_out],
            "stderr_truncated": truncated[r_err],
            "wall": wall,
            "cpu": ru.ru_utime + ru.ru_stime,
        }

    def kill_all_but(self, pid: int) -> None:
        """Stop the whole request tree now (timeouts, floods, leftover orphans)."""
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the child's session/group first: atomic against fork bombs
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if self.mode == "ns":
            with suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        else:
            for p in self._descendants():
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)

    def _child(self, req: dict[str, Any], r_in: int, w_out: int, w_err: int,
               compiled: types.CodeType | BaseException | None) -> None:
        os.setsid()
        os.dup2(r_in, 0)
        os.dup2(w_out, 1)
        os.dup2(w_err, 2)
        os.closerange(3, 65536)
        for s in self.inherited_signals:
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.umask(0o022)
        self.guard.confine()
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
            with suppress(ValueError, OSError):
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
            with suppress(BaseException):
                os.write(2, b"MemoryError\n")
            os._exit(1)
        except BaseException as e:
            with suppress(BaseException):  # hide this server's own frame
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
        import selectors  # noqa: F401  (used by every request: imported before the heap is frozen)

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
                changed = self.guard.changed()
                if changed:
                    raise RuntimeError(f"the fork server's {changed} changed during the request")
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
