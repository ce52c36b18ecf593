"""Workspaces on the ``e2b`` backend: one e2b sandbox per workspace (e2b sandboxes are persistent).

At start the workspace server (:mod:`agentrl.sandboxes._wsserver`, with the
fork server's guard) is written into the sandbox's ``/tmp/.agentrl`` by one
``run_code`` cell; each call is then one cell that runs that server in
``once`` mode on the call's frame and prints the reply frames base64-encoded
on one marked line. So exec/read/write, timeouts, caps and the file rule are
the same as on ``local`` and ``docker``, over the code-interpreter wire the
one-shot backend already speaks (the tests' local debug server speaks it too).
Closing kills the sandbox (``kill()``). ``prepare`` is not offered: e2b
templates are the way to pre-build state there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workspace import PreparedState, Workspace, WorkspaceError, WorkspaceSpec

if TYPE_CHECKING:
    from .e2b import E2BSandbox

_HDR = struct.Struct(">I")
MARK = "__agentrl_ws__ "
SERVER_DIR = "/tmp/.agentrl"


def _install_cell(roots: list[str]) -> str:
    files = {name: base64.b64encode(Path(__file__).with_name(name).read_bytes()).decode()
             for name in ("_wsserver.py", "_forkserver.py")}
    return ("import base64 as _b, os as _o\n"
            f"_o.makedirs({SERVER_DIR!r}, exist_ok=True)\n"
            f"for _n, _d in {files!r}.items():\n"
            f"    open({SERVER_DIR!r} + '/' + _n, 'wb').write(_b.b64decode(_d))\n"
            f"for _r in {roots!r}:\n"
            "    _o.makedirs(_r, exist_ok=True)\n"
            f"print({MARK!r} + 'installed')\n")


def _call_cell(frame: bytes, workdir: str, roots: list[str], timeout_s: float) -> str:
    argv = ["python3", "-I", "-S", f"{SERVER_DIR}/_wsserver.py", "once", workdir, *roots]
    return ("import base64 as _b, subprocess as _s\n"
            f"_p = _s.run({argv!r}, input=_b.b64decode({base64.b64encode(frame).decode()!r}), "
            f"capture_output=True, timeout={timeout_s!r})\n"
            f"print({MARK!r} + _b.b64encode(_p.stdout).decode())\n")


class E2BWorkspace(Workspace):
    """One workspace in its own e2b sandbox (see the module docstring)."""

    def __init__(self, sandbox: E2BSandbox, spec: WorkspaceSpec, prepared: PreparedState | None = None) -> None:
        if prepared is not None:
            raise WorkspaceError("the e2b backend has no prepare(): build an e2b template for pre-built state")
        super().__init__(spec, prepared)
        self.sandbox = sandbox
        self.backstop_s = sandbox.config.slack_s
        self.sb: Any = None

    async def _cell(self, code: str, timeout_s: float) -> str:
        c = self.sandbox.config
        async with asyncio.timeout(timeout_s + 5):
            execution = await self.sb.run_code(code, language="python", timeout=timeout_s,
                                               request_timeout=c.request_timeout_s)
        if execution.error is not None:
            raise WorkspaceError(f"e2b cell failed: {execution.error.name}: {execution.error.value}")
        line = next((ln for ln in reversed("".join(execution.logs.stdout).splitlines()) if ln.startswith(MARK)), None)
        if line is None:
            raise WorkspaceError("the e2b cell printed no answer")
        return line[len(MARK):]

    async def _start(self) -> None:
        try:
            self.sb = await self.sandbox._create()
            await self._cell(_install_cell(self.spec.roots()), self.sandbox.config.request_timeout_s)
        except WorkspaceError:
            raise
        except Exception as e:
            raise WorkspaceError(f"the e2b workspace failed to start: {type(e).__name__}: {e}") from e

    async def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        from e2b import SandboxException, TimeoutException

        data = json.dumps(msg).encode()
        try:
            out = base64.b64decode(await self._cell(
                _call_cell(_HDR.pack(len(data)) + data, self.spec.workdir, self.spec.roots(), timeout_s + 5),
                timeout_s + self.backstop_s))
        except (SandboxException, TimeoutException) as e:
            raise WorkspaceError(f"e2b: {type(e).__name__}: {e}") from e
        frames, i = [], 0
        while i + 4 <= len(out):
            n = _HDR.unpack(out[i:i + 4])[0]
            frames.append(json.loads(out[i + 4:i + 4 + n]))
            i += 4 + n
        if len(frames) < 2:
            raise WorkspaceError("the workspace server in the e2b sandbox gave no answer")
        reply: dict[str, Any] = frames[1]
        return reply

    async def _teardown(self) -> None:
        if self.sb is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.sandbox._kill(self.sb))
