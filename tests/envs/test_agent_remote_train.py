"""`agentrl train` with the `agent` env in remote mode: the agents are other OS processes, or run in docker.

The run is examples/openai-agent/remote.yaml with a tiny random model and a few
small steps; the agents are examples/openai-agent/remote_agent.py, knowing only
the gateway's address and token: separate processes running agent.py's solve()
on the plain `openai` SDK, or one docker container (the sandbox image has only
python3-minimal: the stdlib urllib agent) on the host network, which is how a
container reaches the run's loopback gateway when dockerd runs with
``--bridge=none``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.sandboxes.docker import setup_docker_host
from agentrl.store.trajectory_store import TrajectoryStore

pytestmark = [pytest.mark.slow, pytest.mark.model]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "openai-agent"
TOKEN = "remote-train-token-0123456"
IMAGE = "agentrl/python:3.11"
STEPS, GROUPS, GROUP_SIZE = 2, 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def train(tmp_path: Path, model: str, port: int) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train", str(EXAMPLE / "remote.yaml"),
        f"model.path={model}", f"run.output_dir={tmp_path}", "run.name=ci", "engine.dtype=fp32", "trainer.dtype=fp32",
        f"run.steps={STEPS}", f"run.eval_every={STEPS}", "run.eval_tasks=4", f"run.save_every={STEPS}",
        "run.loggers=[jsonl]", f"rollout.group_size={GROUP_SIZE}", f"rollout.groups_per_step={GROUPS}",
        "rollout.max_new_tokens_per_turn=12", "rollout.max_turns=2", "rollout.max_in_flight=8",
        "trainer.entropy_coef=0.01", f"env.gateway.port={port}", f"env.gateway.token={TOKEN}",
        "env.claim_timeout_s=120",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path)


def check_run(run: Path, episodes_played: int) -> None:
    """Steps trained on the remote agents' episodes, stored token-exact with their sessions."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "grad_norm" in r] == list(range(1, STEPS + 1))
    assert any(r["step"] == STEPS and "eval/reward_mean" in r for r in rows)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        records = list(store.iter_records())
    trained = [r.trajectory for r in records if r.status == "trained"]
    assert len(trained) >= STEPS * GROUPS * GROUP_SIZE  # branches may add samples to a group
    assert episodes_played >= len({t.info["gateway"]["session"] for t in trained})  # type: ignore[index,call-overload]
    for traj in trained:
        assert traj.env == "agent" and traj.error is None and sum(traj.loss_mask) > 0
        assert traj.turns and all(traj.token_ids[t.start : t.end] for t in traj.turns)
        assert "prompt" in traj.task and traj.messages[0].role == "system"
    assert any(r.status == "eval" for r in records)


def played(output: str) -> int:
    """Episodes an agent process reports it finished (its last line)."""
    line = [ln for ln in output.splitlines() if ln.startswith("remote agent done:")][-1]
    return int(line.split("episodes=")[1].split()[0])


def test_train_on_episodes_of_agent_processes(tmp_path: Path, tiny_llama_path: str) -> None:
    port = free_port()
    agent = [sys.executable, str(EXAMPLE / "remote_agent.py"), "--gateway", f"http://127.0.0.1:{port}",
             "--token", TOKEN, "--workers", "3", "--openai", "--patience-s", "20"]  # fmt: skip
    agents = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
              for _ in range(2)]  # fmt: skip
    try:
        proc = train(tmp_path, tiny_llama_path, port)
        outputs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(a.returncode == 0 for a in agents), [err[-2000:] for _, err in outputs]
    counts = [played(out) for out, _ in outputs]
    assert all(n > 0 for n in counts), counts  # both processes took part
    check_run(tmp_path / "ci", sum(counts))


@pytest.fixture(scope="module")
def docker_client() -> Iterator[Any]:
    """A docker client when a daemon answers and the sandbox image exists (tests/sandboxes' rule), else skip."""
    try:
        import docker
    except ImportError:
        pytest.skip("the docker SDK is not installed")
    setup_docker_host()
    try:
        client = docker.from_env(timeout=30)
        client.ping()
        client.images.get(IMAGE)
    except Exception as e:
        pytest.skip(f"no docker daemon with image {IMAGE} ({type(e).__name__}); run .ci/setup_sandboxes.sh")
    yield client
    client.close()


@pytest.mark.docker
def test_train_on_episodes_of_an_agent_in_a_docker_container(
    docker_client: Any, tmp_path: Path, tiny_llama_path: str
) -> None:
    port = free_port()
    container = docker_client.containers.run(
        IMAGE,
        ["python3", "/agent/remote_agent.py", "--gateway", f"http://127.0.0.1:{port}", "--token", TOKEN,
         "--workers", "4", "--patience-s", "20"],
        network_mode="host",  # dockerd runs with --bridge=none: the host network is how it reaches the run
        volumes={str(EXAMPLE): {"bind": "/agent", "mode": "ro"}},
        read_only=True, user="65534:65534", mem_limit="256m", pids_limit=64, detach=True,
        environment={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        proc = train(tmp_path, tiny_llama_path, port)
        status = container.wait(timeout=120)
        logs = container.logs().decode()
    finally:
        container.remove(force=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert status["StatusCode"] == 0, logs[-2000:]
    check_run(tmp_path / "ci", played(logs))
