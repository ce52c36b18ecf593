"""``e2b`` backend: a pool of e2b-code-interpreter ``AsyncSandbox`` instances.

Every request becomes one ``run_code`` of a small Python *runner* that makes a
fresh work dir, writes the files, runs the command (``python3 main.py``,
``bash main.sh`` or ``argv``) in its own session with rlimits, stdin and a
wall timeout, caps the output, collects ``fetch_files``, kills the session's
processes, deletes the work dir and prints one JSON line that we parse. So
every backend feature works the same on e2b, and nothing depends on the
Jupyter kernel's state (the runner lives in a function it deletes).

Per-call timeouts: ``run_code(timeout=wall + slack)``. SDK errors map to
statuses (execution timeout -> ``timeout``; anything else -> ``sandbox_error``);
a sandbox that failed or timed out is killed (always, in ``finally``) and
replaced. ``debug: true`` (or ``E2B_DEBUG=true``) talks to a local server
speaking the code-interpreter protocol instead of the e2b cloud.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any

from pydantic import ConfigDict, Field

from .base import (
    BaseSandbox,
    ExecRequest,
    ExecResult,
    LimitConfig,
    QueueConfig,
    Status,
    decode_capped,
    sandbox_error,
)
from .e2b_workspace import E2BWorkspace
from .workspace import PreparedState, WorkspaceSpec, WorkspaceUnsupported

RESULT_MARK = "__agentrl_result__ "

RUNNER = r'''
def _agentrl_run(spec_b64):
    import base64, json, os, resource, shutil, signal, stat, subprocess, sys, tempfile, time
    spec = json.loads(base64.b64decode(spec_b64))
    def pids():
        return {int(p) for p in os.listdir("/proc") if p.isdigit()}

    before = pids()
    work = tempfile.mkdtemp(prefix="agentrl-")
    logs = tempfile.mkdtemp(prefix="agentrl-logs-")
    out = {"exit_code": None, "timeout": False, "stdout": "", "stderr": "", "files": {}}
    try:
        for name, data in spec["files"].items():
            path = os.path.join(work, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(data))
        def limits():
            cpu = max(1, int(spec["cpu"] + 0.999))
            for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (spec["mem"],) * 2),
                                (resource.RLIMIT_FSIZE, (spec["max_file"],) * 2), (resource.RLIMIT_CORE, (0, 0))):
                try:
                    resource.setrlimit(kind, value)
                except (ValueError, OSError):
                    pass
        env = dict(spec["env"], HOME=work, TMPDIR=work)
        t0 = time.monotonic()
        # Output goes to files (capped by RLIMIT_FSIZE), never into this process's memory.
        fo, fe = tempfile.TemporaryFile(dir=logs), tempfile.TemporaryFile(dir=logs)
        # A tiny supervisor is the code's parent: if the code kills its parent, only the
        # supervisor dies (this kernel survives) and the missing status file says so.
        status_file = os.path.join(logs, "status")
        waiter = ("import subprocess, sys\n"
                  "try:\n"
                  "    rc = subprocess.call(sys.argv[2:])\n"
                  "except OSError as e:\n"
                  "    print(f'cannot execute {sys.argv[2]!r}: {e.strerror}', file=sys.stderr)\n"
                  "    rc = 127\n"
                  "open(sys.argv[1], 'w').write(str(rc))\n")
        p = subprocess.Popen([sys.executable, "-I", "-S", "-c", waiter, status_file, *spec["argv"]], cwd=work,
                             env=env, stdin=subprocess.PIPE, stdout=fo, stderr=fe, start_new_session=True,
                             preexec_fn=limits)
        try:
            p.communicate(base64.b64decode(spec["stdin"]), timeout=spec["wall"])
        except subprocess.TimeoutExpired:
            out["timeout"] = True
        for _ in range(50):  # the process group, then anything new that escaped it (setsid orphans)
            leftover = [q for q in pids() - before if q != os.getpid()]
            for q in [-p.pid, *leftover]:
                try:
                    os.kill(q, signal.SIGKILL)
                except OSError:
                    pass
            if p.poll() is not None and not [q for q in pids() - before if q != os.getpid()
                                              and os.path.exists(f"/proc/{q}/cmdline")
                                              and open(f"/proc/{q}/cmdline", "rb").read()]:
                break
            time.sleep(0.01)
        p.wait()
        cap = spec["max_out"]
        fo.seek(0)
        fe.seek(0)
        so, se = fo.read(cap + 1), fe.read(cap + 1)
        out["wall"] = time.monotonic() - t0
        try:
            with open(status_file) as f:
                out["exit_code"] = int(f.read())
        except (OSError, ValueError):
            out["exit_code"] = p.returncode
            out["supervisor_killed"] = not out["timeout"]
        out["stdout"] = base64.b64encode(so[:cap + 1]).decode()
        out["stderr"] = base64.b64encode(se[:cap + 1]).decode()
        root = os.path.realpath(work)
        for name in spec["fetch_files"]:  # regular files inside the work dir only (no link out, no FIFO)
            path = os.path.realpath(os.path.join(work, name))
            if os.path.commonpath([root, path]) != root:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            with open(fd, "rb") as f:
                out["files"][name] = base64.b64encode(f.read(spec["max_file"])).decode()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    print("__agentrl_result__ " + json.dumps(out), flush=True)
'''


class E2BConfig(QueueConfig):
    """Settings of the ``e2b`` backend."""

    model_config = ConfigDict(extra="forbid")

    template: str | None = Field(
        default=None, description="e2b template name or id; default: the SDK's code-interpreter one"
    )
    api_key: str | None = Field(default=None, description="e2b API key; default: $E2B_API_KEY")
    debug: bool = Field(
        default=False,
        description="talk to a local code-interpreter server, not the e2b cloud (no key); false: $E2B_DEBUG",
    )
    sandbox_url: str | None = Field(
        default=None, description="URL of the code-interpreter server; default: $E2B_SANDBOX_URL, else the SDK's own"
    )
    pool_size: int = Field(
        default=2, ge=1, le=256, description="e2b sandboxes in the pool, i.e. requests run at once"
    )
    sandbox_timeout_s: int = Field(
        default=600,
        ge=10,
        description="seconds each e2b sandbox lives; an expired one fails its next request and is replaced",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="seconds allowed for each e2b API request"
    )
    slack_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds beyond a request's wall_timeout_s for the run_code round trip",
    )
    max_uses: int = Field(default=500, ge=1, description="requests a sandbox serves before it is replaced")


def runner_code(request: ExecRequest) -> str:
    """The Python cell that runs ``request`` inside an e2b sandbox."""
    spec = {
        "files": {k: base64.b64encode(v).decode() for k, v in request.all_files().items()},
        "fetch_files": request.fetch_files,
        "stdin": base64.b64encode(request.stdin_bytes()).decode(),
        "argv": request.command(),
        "wall": request.wall_timeout_s,
        "cpu": request.cpu_limit_s,
        "mem": request.memory_mb << 20,
        "max_out": request.max_output_bytes,
        "max_file": request.max_file_bytes,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
    }
    spec_b64 = base64.b64encode(json.dumps(spec).encode()).decode()
    return f"{RUNNER}\ntry:\n    _agentrl_run({spec_b64!r})\nfinally:\n    del _agentrl_run\n"


def parse_runner_output(stdout: str, request: ExecRequest, wall_s: float) -> ExecResult:
    """Turn the runner's JSON line into an :class:`ExecResult`."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(RESULT_MARK)), None)
    if line is None:
        return sandbox_error(f"e2b runner printed no result: {stdout[-500:]!r}", wall_s=wall_s)
    out = json.loads(line[len(RESULT_MARK):])
    cap = request.max_output_bytes
    so, so_cut = decode_capped(base64.b64decode(out["stdout"]), cap)
    se, se_cut = decode_capped(base64.b64decode(out["stderr"]), cap)
    code = out["exit_code"]
    status: Status
    if out["timeout"] or code in (-24,):  # SIGXCPU
        status = "timeout"
    elif so_cut or se_cut:
        status = "output_limit"
    elif out.get("supervisor_killed"):
        status = "error"
    elif code == -9 or (code != 0 and se.rstrip().endswith("MemoryError")):
        status = "oom"
    elif code != 0:
        status = "error"
    else:
        status = "ok"
    return ExecResult(status=status, exit_code=code, stdout=so, stderr=se, stdout_truncated=so_cut,
                      stderr_truncated=se_cut, wall_s=out.get("wall", wall_s),
                      files={k: base64.b64decode(v) for k, v in out["files"].items()})


class E2BSandbox(BaseSandbox):
    """e2b cloud sandboxes: a pool of e2b-code-interpreter ``AsyncSandbox``. See the module docstring."""

    Config = E2BConfig

    def __init__(self, config: E2BConfig | None = None) -> None:
        self.config = config or E2BConfig()
        super().__init__(LimitConfig(max_concurrency=self.config.pool_size, max_queue=self.config.max_queue,
                                     queue_timeout_s=self.config.queue_timeout_s))
        self._idle: asyncio.Queue[Any | None] = asyncio.Queue()
        for _ in range(self.config.pool_size):
            self._idle.put_nowait(None)
        self._uses: dict[int, int] = {}
        self._live: set[Any] = set()

    @classmethod
    def from_config(cls, config: E2BConfig | dict[str, Any] | None = None) -> E2BSandbox:
        return cls(config if isinstance(config, E2BConfig) else E2BConfig(**(config or {})))

    async def _create(self) -> Any:
        from e2b_code_interpreter import AsyncSandbox  # lazy: only this backend needs the SDK

        c = self.config
        kwargs: dict[str, Any] = {"timeout": c.sandbox_timeout_s, "request_timeout": c.request_timeout_s}
        if c.template:
            kwargs["template"] = c.template
        if c.api_key:
            kwargs["api_key"] = c.api_key
        if c.debug:
            kwargs["debug"] = True
        if c.sandbox_url:
            kwargs["sandbox_url"] = c.sandbox_url
        async with asyncio.timeout(c.request_timeout_s + 5):
            sb = await AsyncSandbox.create(**kwargs)
        self._live.add(sb)
        self._uses[id(sb)] = 0
        return sb

    async def _kill(self, sb: Any) -> None:
        self._live.discard(sb)
        self._uses.pop(id(sb), None)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.config.request_timeout_s):
                await sb.kill()

    async def _execute(self, request: ExecRequest) -> ExecResult:
        from e2b import SandboxException, TimeoutException

        async with asyncio.timeout(self.config.queue_timeout_s):
            sb = await self._idle.get()
        keep = False
        t0 = time.perf_counter()
        try:
            if sb is None:
                sb = await self._create()
            self._uses[id(sb)] += 1
            deadline = request.wall_timeout_s + self.config.slack_s
            try:
                async with asyncio.timeout(deadline + 5):
                    execution = await sb.run_code(runner_code(request), language="python", timeout=deadline,
                                                  request_timeout=self.config.request_timeout_s)
            except (TimeoutException, TimeoutError) as e:
                return ExecResult(status="timeout", wall_s=time.perf_counter() - t0, message=f"e2b: {e}")
            except SandboxException as e:
                return sandbox_error(f"e2b: {type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)
            wall = time.perf_counter() - t0
            if execution.error is not None:
                return sandbox_error(f"e2b runner failed: {execution.error.name}: {execution.error.value}",
                                     wall_s=wall)
            result = parse_runner_output("".join(execution.logs.stdout), request, wall)
            keep = result.status != "sandbox_error" and self._uses[id(sb)] < self.config.max_uses
            return result
        finally:
            if keep:
                self._idle.put_nowait(sb)
            else:
                self._idle.put_nowait(None)
                if sb is not None:
                    await self._kill(sb)

    def workspace(self, spec: WorkspaceSpec | None = None, *, prepared: PreparedState | None = None) -> E2BWorkspace:
        """One persistent workspace in its own e2b sandbox (``async with``); see agentrl.sandboxes.e2b_workspace."""
        return E2BWorkspace(self, spec or WorkspaceSpec(), prepared)

    async def prepare(self, spec: WorkspaceSpec) -> PreparedState:
        raise WorkspaceUnsupported("the e2b backend has no prepare(): pre-build a task's state as an e2b template")

    async def close(self) -> None:
        await super().close()
        await asyncio.gather(*(self._kill(sb) for sb in list(self._live)), return_exceptions=True)
