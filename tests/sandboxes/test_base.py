"""ExecRequest/ExecResult validation, the SandboxFusion shape, the limiter and the queue."""

from __future__ import annotations

import asyncio
import base64

import pytest
from pydantic import ValidationError

from agentrl.sandboxes.base import (
    ConcurrencyLimiter,
    ExecRequest,
    ExecResult,
    LimitConfig,
    LimitedSandbox,
    Sandbox,
)


def test_request_validation_names_the_problem() -> None:
    with pytest.raises(ValidationError, match="code"):
        ExecRequest()
    with pytest.raises(ValidationError, match="relative path"):
        ExecRequest(code="", files={"../escape": "x"})
    with pytest.raises(ValidationError, match="language"):
        ExecRequest(code="", language="cobol")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        ExecRequest(code="", timeout=3)  # type: ignore[call-arg]
    r = ExecRequest(code="print(1)", files={"a.txt": "x"})
    assert r.all_files() == {"a.txt": b"x", "main.py": b"print(1)"}
    assert r.cpu_limit_s == r.wall_timeout_s


def test_sandboxfusion_round_trip() -> None:
    body = {"code": "print(1)", "language": "python", "run_timeout": 3, "memory_limit_MB": 128, "stdin": "x",
            "files": {"d.txt": base64.b64encode(b"data").decode()}, "fetch_files": ["o.txt"]}
    req = ExecRequest.from_sandboxfusion(body)
    assert (req.wall_timeout_s, req.memory_mb, req.files, req.fetch_files) == (3.0, 128, {"d.txt": b"data"},
                                                                               ["o.txt"])
    with pytest.raises(ValueError, match="unknown /run_code keys"):
        ExecRequest.from_sandboxfusion({"code": "", "bogus": 1})
    out = ExecResult(status="timeout", exit_code=-9, stdout="a", wall_s=3.0, files={"o.txt": b"z"}).to_sandboxfusion()
    assert out["status"] == "Failed" and out["run_result"]["status"] == "TimeLimitExceeded"
    assert out["files"] == {"o.txt": base64.b64encode(b"z").decode()}
    ok = ExecResult(status="ok", exit_code=0).to_sandboxfusion()
    assert ok["status"] == "Success" and ok["run_result"]["return_code"] == 0


class SlowSandbox:
    """A minimal third-party Sandbox: counts how many runs overlap."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    async def run(self, request: ExecRequest) -> ExecResult:
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.02)
        self.active -= 1
        return ExecResult(status="ok", stdout=request.code or "")

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> SlowSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


async def test_limited_sandbox_caps_concurrency_and_bounds_the_queue() -> None:
    inner = SlowSandbox()
    assert isinstance(inner, Sandbox)
    async with LimitedSandbox(inner, LimitConfig(max_concurrency=3, max_queue=100)) as sb:
        results = await asyncio.gather(*(sb.run(ExecRequest(code=str(i))) for i in range(20)))
    assert [r.stdout for r in results] == [str(i) for i in range(20)]
    assert inner.peak == 3

    inner = SlowSandbox()
    sb2 = LimitedSandbox(inner, LimitConfig(max_concurrency=1, max_queue=2))
    results = await asyncio.gather(*(sb2.run(ExecRequest(code="x")) for _ in range(6)))
    statuses = [r.status for r in results]
    assert statuses.count("ok") == 3 and statuses.count("sandbox_error") == 3
    assert all("queue full" in r.message for r in results if r.status == "sandbox_error")


async def test_queue_wait_has_a_deadline() -> None:
    limiter = ConcurrencyLimiter(1, queue_timeout_s=0.05)
    async with limiter:
        with pytest.raises(TimeoutError):
            async with limiter:
                pass
    async with limiter:  # released properly
        assert limiter.running == 1
