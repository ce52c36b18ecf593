"""Backend-specific behaviour: docker lock-down and replacement, e2b/SandboxFusion error mapping."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from agentrl.sandboxes.base import ExecRequest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["exec", "server"])
async def test_docker_containers_are_locked_down_and_replaced(docker_reason: str | None, mode: str) -> None:
    if docker_reason:
        pytest.skip(docker_reason)
    from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

    async with DockerSandbox(DockerConfig(pool_size=1, max_uses=3, mode=mode)) as sb:  # type: ignore[arg-type]
        (container,) = sb._all.values()
        container.reload()
        host = container.attrs["HostConfig"]
        assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"][0]
        assert host["Memory"] > 0 and host["PidsLimit"] > 0 and host["NanoCpus"] > 0
        assert set(host["Tmpfs"]) == {"/work", "/tmp"}
        assert container.attrs["Config"]["User"] == "65534:65534"

        r = await sb.run(ExecRequest(code="import time; time.sleep(60)", wall_timeout_s=1))
        assert r.status == "timeout"
        r = await sb.run(ExecRequest(code="print('next')"))
        assert r.ok and r.stdout == "next\n"
        (replacement,) = sb._all.values()
        assert replacement.id != container.id  # replaced after the timeout
        for _ in range(3):
            assert (await sb.run(ExecRequest(code="pass"))).ok
        assert replacement.id not in sb._all  # and after max_uses
    assert sb._all == {}


@pytest.mark.docker
async def test_docker_never_pulls_a_missing_image(docker_reason: str | None) -> None:
    if docker_reason:
        pytest.skip(docker_reason)
    from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

    sb = DockerSandbox(DockerConfig(image="agentrl/does-not-exist:0", pool_size=1))
    r = await sb.run(ExecRequest(code="print(1)"))
    await sb.close()
    assert r.status == "sandbox_error" and "never pulled" in r.message and "does-not-exist" in r.message


async def test_e2b_unreachable_server_is_a_sandbox_error() -> None:
    from agentrl.sandboxes.e2b import E2BConfig, E2BSandbox

    async with E2BSandbox(E2BConfig(debug=True, sandbox_url=f"http://127.0.0.1:{_free_port()}",
                                    request_timeout_s=1)) as sb:
        r = await sb.run(ExecRequest(code="print(1)"))
    assert r.status == "sandbox_error", r


async def test_e2b_sdk_timeout_maps_to_timeout(e2b_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's own execution deadline fires (the cell outlives it): status timeout, sandbox replaced."""
    from agentrl.sandboxes import e2b as e2b_mod

    async with e2b_mod.E2BSandbox(e2b_mod.E2BConfig(debug=True, sandbox_url=e2b_server.url, slack_s=0.5,
                                                    pool_size=1)) as sb:
        assert (await sb.run(ExecRequest(code="print(1)"))).stdout == "1\n"
        with monkeypatch.context() as m:
            m.setattr(e2b_mod, "runner_code", lambda request: "import time\ntime.sleep(3)\n")
            r = await sb.run(ExecRequest(code="print(1)", wall_timeout_s=0.5))
        assert r.status == "timeout" and "e2b" in r.message, r
        assert (await sb.run(ExecRequest(code="print('again')"))).stdout == "again\n"


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="live e2b test needs E2B_API_KEY and the internet")
async def test_e2b_live() -> None:
    from agentrl.sandboxes.e2b import E2BConfig, E2BSandbox

    async with E2BSandbox(E2BConfig(pool_size=1)) as sb:
        r = await sb.run(ExecRequest(code="import sys; print(sys.stdin.read() * 2)", stdin="ab"))
        assert r.status == "ok" and r.stdout == "abab\n", r
        r = await sb.run(ExecRequest(code="import time; time.sleep(30)", wall_timeout_s=1))
        assert r.status == "timeout", r


async def test_sandboxfusion_unreachable_and_bad_responses() -> None:
    from agentrl.sandboxes.sandboxfusion import SandboxFusionConfig, SandboxFusionSandbox, from_body

    async with SandboxFusionSandbox(SandboxFusionConfig(url=f"http://127.0.0.1:{_free_port()}")) as sb:
        r = await sb.run(ExecRequest(code="print(1)"))
    assert r.status == "sandbox_error" and "unreachable" in r.message
    req = ExecRequest(code="x")
    assert from_body({"status": "SandboxError", "message": "pod died"}, req, 0.1).status == "sandbox_error"
    ok = from_body({"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "1\n",
                                                       "stderr": "", "execution_time": 0.01}}, req, 0.1)
    assert ok.status == "ok" and ok.stdout == "1\n"
    tle = from_body({"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "return_code": None}}, req, 1)
    assert tle.status == "timeout"
