"""``sandboxfusion`` backend: an aiohttp client for an existing SandboxFusion service.

It speaks the documented ``POST /run_code`` schema (code, language,
run_timeout, memory_limit_MB, stdin, files/fetch_files as base64 -> status,
message, run_result{status, return_code, stdout, stderr, execution_time},
files). The service does its own isolation; we add a connection pool sized to
the concurrency limit, a deadline per call, output caps and status mapping.
"""

from __future__ import annotations

import base64
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
    sandbox_error,
)


class SandboxFusionConfig(QueueConfig):
    """Settings of the ``sandboxfusion`` backend."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        default="http://localhost:8080", description="base URL of the SandboxFusion service (POST {url}/run_code)"
    )
    max_concurrency: int = Field(
        default=16, ge=1, description="requests in flight at once (also the HTTP pool size)"
    )
    slack_s: float = Field(
        default=10.0, gt=0, description="seconds beyond a request's wall_timeout_s for the HTTP round trip"
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="extra HTTP headers sent with every request"
    )


def to_body(request: ExecRequest) -> dict[str, Any]:
    """Our request as a ``/run_code`` body."""
    return {
        "code": request.code or "",
        "language": request.language,
        "run_timeout": request.wall_timeout_s,
        "memory_limit_MB": request.memory_mb,
        "stdin": request.stdin_bytes().decode("utf-8", "replace"),
        "files": {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode()
                  for k, v in request.files.items()},
        "fetch_files": request.fetch_files,
    }


def from_body(body: dict[str, Any], request: ExecRequest, wall_s: float) -> ExecResult:
    """A ``/run_code`` response as our result."""
    run = body.get("run_result") or {}
    compile_ = body.get("compile_result") or {}
    if body.get("status") == "SandboxError" or (not run and not compile_):
        return sandbox_error(f"sandboxfusion: {body.get('message') or body!r}"[:2000], wall_s=wall_s)
    cap = request.max_output_bytes
    raw_out = (run.get("stdout") or "").encode()
    raw_err = ((compile_.get("stderr") or "") + (run.get("stderr") or "")).encode()
    out_cut, err_cut = len(raw_out) > cap, len(raw_err) > cap
    code = run.get("return_code")
    stderr = raw_err[:cap].decode("utf-8", "replace")
    status: Status
    if run.get("status") == "TimeLimitExceeded" or compile_.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif out_cut or err_cut:
        status = "output_limit"
    elif code in (137, -9) or (code not in (0, None) and stderr.rstrip().endswith("MemoryError")):
        status = "oom"
    elif code != 0 or body.get("status") != "Success":
        status = "error"
    else:
        status = "ok"
    return ExecResult(
        status=status,
        exit_code=code,
        stdout=raw_out[:cap].decode("utf-8", "replace"),
        stderr=stderr,
        stdout_truncated=out_cut,
        stderr_truncated=err_cut,
        wall_s=float(run.get("execution_time") or wall_s),
        files={k: base64.b64decode(v) for k, v in (body.get("files") or {}).items()},
        message=body.get("message") or "",
    )


class SandboxFusionSandbox(BaseSandbox):
    """Client for an existing SandboxFusion ``/run_code`` service. See the module docstring."""

    Config = SandboxFusionConfig

    def __init__(self, config: SandboxFusionConfig | None = None) -> None:
        self.config = config or SandboxFusionConfig()
        super().__init__(LimitConfig(max_concurrency=self.config.max_concurrency, max_queue=self.config.max_queue,
                                     queue_timeout_s=self.config.queue_timeout_s))
        self._session: Any = None

    @classmethod
    def from_config(cls, config: SandboxFusionConfig | dict[str, Any] | None = None) -> SandboxFusionSandbox:
        return cls(config if isinstance(config, SandboxFusionConfig) else SandboxFusionConfig(**(config or {})))

    def _client(self) -> Any:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.config.headers)
        return self._session

    async def _execute(self, request: ExecRequest) -> ExecResult:
        import aiohttp

        if request.argv:
            return sandbox_error("the sandboxfusion backend runs `code` only (no argv)")
        if request.network:
            return sandbox_error("network access cannot be requested through sandboxfusion's /run_code")
        t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=request.wall_timeout_s + self.config.slack_s)
        try:
            async with self._client().post(f"{self.config.url.rstrip('/')}/run_code", json=to_body(request),
                                           timeout=timeout) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    return sandbox_error(f"sandboxfusion HTTP {resp.status}: {text[:500]}",
                                         wall_s=time.perf_counter() - t0)
                body = await resp.json()
        except TimeoutError:
            return ExecResult(status="timeout", wall_s=time.perf_counter() - t0,
                              message="sandboxfusion did not answer in time")
        except aiohttp.ClientError as e:
            return sandbox_error(f"sandboxfusion unreachable: {type(e).__name__}: {e}",
                                 wall_s=time.perf_counter() - t0)
        return from_body(body, request, time.perf_counter() - t0)

    async def close(self) -> None:
        await super().close()
        if self._session is not None:
            await self._session.close()
            self._session = None
