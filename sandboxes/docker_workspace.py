"""Workspaces on the ``docker`` backend: one container per workspace.

The container idles on ``sleep infinity`` under docker's init (which reaps
what commands leave behind), with no network unless the spec asks for it,
memory/pids/CPU limits, all capabilities dropped but the few a root shell
needs to manage its own files (``CHOWN``, ``DAC_OVERRIDE``, ``FOWNER``,
``FSETID``, ``SETUID``, ``SETGID``, ``KILL``) and ``no-new-privileges``. Each
call is one ``docker exec`` of :mod:`agentrl.sandboxes._wsserver` in ``once``
mode (the same server as on ``local``, copied into ``/.agentrl`` at start), so
timeouts, output caps and the file rule behave the same on both backends.

Copy-on-write group start: ``prepare`` runs the set-up in a container and
``docker commit``\\ s it; forks are containers of that image (one overlay2
layer shared by the group). Containers and images carry the label
``org.agentrl.sandbox=<host>:<pid>``; those of dead processes (a killed run)
are removed when the next workspace starts. The disk size is not enforced
(``storage_opt`` needs xfs with project quotas).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import struct
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workspace import PreparedState, Workspace, WorkspaceError, WorkspaceSpec

if TYPE_CHECKING:
    from .docker import DockerSandbox

_HDR = struct.Struct(">I")
_ids = itertools.count()
_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL"]
SERVER_FILES = ("_wsserver.py", "_forkserver.py")


def _server_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in SERVER_FILES:
            data = Path(__file__).with_name(name).read_bytes()
            info = tarfile.TarInfo(f".agentrl/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerPrepared(PreparedState):
    """A prepared state on docker: an image committed from the set-up's container."""

    def __init__(self, spec: WorkspaceSpec, setup_s: float, sandbox: DockerSandbox, image_id: str) -> None:
        super().__init__(spec, setup_s)
        self.sandbox, self.image_id = sandbox, image_id

    async def close(self) -> None:
        if self.closed:
            return
        await super().close()
        with contextlib.suppress(Exception):
            await self.sandbox._call(self.sandbox.client.images.remove, self.image_id, force=True)


class DockerWorkspace(Workspace):
    """One workspace in its own container (see the module docstring)."""

    def __init__(self, sandbox: DockerSandbox, spec: WorkspaceSpec, prepared: PreparedState | None = None) -> None:
        if prepared is not None and not isinstance(prepared, DockerPrepared):
            raise WorkspaceError(f"a {type(prepared).__name__} cannot be forked on the docker backend")
        super().__init__(spec, prepared)
        self.sandbox = sandbox
        self.backstop_s = sandbox.config.backstop_s
        self.container: Any = None

    def _create_sync(self) -> Any:
        sb, c, spec = self.sandbox, self.sandbox.config, self.spec
        sb.reap_stale_workspaces_sync()
        image = self.prepared.image_id if isinstance(self.prepared, DockerPrepared) else (spec.image or c.image)
        import docker.errors

        try:
            sb.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise WorkspaceError(f"docker image {image!r} is not available locally (images are never pulled; "
                                 "build it first, e.g. `agentrl sandbox build-image`)") from None
        container = sb.client.containers.create(
            image, ["sleep", "infinity"],
            name=f"agentrl-ws-{os.getpid()}-{next(_ids)}-{int(time.time() * 1000) % 100000}",
            init=True,
            network_disabled=not spec.network,
            network_mode=None if spec.network else "none",
            mem_limit=f"{spec.memory_mb}m", memswap_limit=f"{spec.memory_mb}m",
            pids_limit=spec.max_processes, nano_cpus=int(c.cpus * 1e9),
            cap_drop=["ALL"], cap_add=_CAPS, security_opt=["no-new-privileges"],
            user=c.workspace_user, working_dir=spec.workdir, environment={},
            labels={c.label: sb.owner}, auto_remove=False,
        )
        try:
            container.put_archive("/", _server_tar())
            container.start()
            roots = " ".join(f"'{r}'" for r in spec.roots())
            code, out = container.exec_run(["sh", "-c", f"mkdir -p {roots}"], user=c.workspace_user)
            if code != 0:
                raise WorkspaceError(f"cannot make the workspace dirs: {out[-500:]!r}")
        except BaseException:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            raise
        return container

    async def _start(self) -> None:
        try:
            self.container = await self.sandbox._call(self._create_sync)
        except WorkspaceError:
            raise
        except Exception as e:
            raise WorkspaceError(f"the docker workspace failed to start: {type(e).__name__}: {e}") from e

    def _exec_sync(self, payload: bytes, deadline_s: float) -> dict[str, Any]:
        from .docker import exec_with_stdin

        c = self.sandbox.config
        api = self.sandbox.client.api
        argv = [c.python, "-I", "-S", "/.agentrl/_wsserver.py", "once", self.spec.workdir, *self.spec.roots()]
        exec_id, out, err = exec_with_stdin(api, self.container.id, argv, payload, deadline_s,
                                            user=c.workspace_user, workdir=self.spec.workdir)  # fmt: skip
        frames = []
        i = 0
        while i + 4 <= len(out):
            n = _HDR.unpack(out[i:i + 4])[0]
            frames.append(json.loads(out[i + 4:i + 4 + n]))
            i += 4 + n
        if len(frames) < 2:
            state = api.exec_inspect(exec_id)
            raise WorkspaceError(f"the workspace server in the container gave no answer (exit "
                                 f"{state.get('ExitCode')}): {err[-1000:].decode(errors='replace')}")
        reply: dict[str, Any] = frames[1]
        return reply

    async def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        data = json.dumps(msg).encode()
        deadline = timeout_s + self.backstop_s
        async with asyncio.timeout(deadline + 5):
            return await asyncio.to_thread(self._exec_sync, _HDR.pack(len(data)) + data, deadline)

    def _kill_now(self) -> None:
        if self.container is not None and not self.closed:  # expiry: remove it now (close removes it too)
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().run_in_executor(None, self._remove_sync)

    def _remove_sync(self) -> None:
        """Remove the container and wait (bounded) until it is gone (a removal may already be under way)."""
        import docker.errors

        with contextlib.suppress(Exception):
            self.container.remove(force=True)
        for _ in range(100):
            try:
                self.sandbox.client.containers.get(self.container.id)
            except docker.errors.NotFound:
                return
            except Exception:
                return
            time.sleep(0.1)

    async def _teardown(self) -> None:
        if self.container is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.sandbox._call(self._remove_sync))


async def prepare_docker(sandbox: DockerSandbox, spec: WorkspaceSpec) -> DockerPrepared:
    """Run ``spec``'s set-up once in a container and commit it as an image; forks start from it."""
    t0 = time.perf_counter()
    ws = DockerWorkspace(sandbox, spec)
    async with ws:
        image = await sandbox._call(
            ws.container.commit, repository="agentrl-ws-prepared", tag=f"{os.getpid()}-{next(_ids)}",
            conf={"Labels": {sandbox.config.label: sandbox.owner}},
        )
    return DockerPrepared(spec, time.perf_counter() - t0, sandbox, image.id)
