"""`agentrl gateway CONFIG`: an agent in another process opens, runs and closes episodes over HTTP; the closed
episodes land in the run's store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from agentrl.store.trajectory_store import TrajectoryStore

pytestmark = [pytest.mark.model, pytest.mark.slow]

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


@contextmanager
def running_gateway(tmp_path: Path, stop: signal.Signals) -> Iterator[str]:
    """`agentrl gateway` on a scripted engine, started as a non-interactive shell starts a background job:
    with SIGINT ignored (the gateway must still stop on it). Yields its URL; on exit sends `stop` and
    asserts a clean exit."""
    config = {
        "run": {"name": "remote", "output_dir": str(tmp_path)},
        "env": {"name": "agent", "agent": "some.module:solve", "tasks": [{"id": "a"}], "gateway": {"model_name": "policy"}},
        "engine": {"name": "scripted", "replies": [CALL, "Answer: 5"]},
        "rollout": {"sampling": {"temperature": 0.7}},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "gateway", str(path), "--token", "admin-token-for-tests-123"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agentrl gateway: http://127.0.0.1:"), line + (proc.stderr.read() if proc.stderr else "")
        yield line.split()[2]
    finally:
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0


def test_sigterm_stops_the_gateway(tmp_path: Path) -> None:
    with running_gateway(tmp_path, signal.SIGTERM) as url:
        assert url.startswith("http://127.0.0.1:")


def test_remote_agent_episodes_are_stored(tmp_path: Path) -> None:
    with running_gateway(tmp_path, signal.SIGINT) as url:
        admin = {"Authorization": "Bearer admin-token-for-tests-123"}
        opened = httpx.post(f"{url}/sessions", json={"task": {"id": "t1", "question": "2 + 3"}}, headers=admin).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        with pytest.raises(openai.BadRequestError, match=r"temperature=1 differs from the trainer's temperature=0\.7"):
            client.chat.completions.create(model="policy", messages=messages, temperature=1.0)  # type: ignore[arg-type]
        first = client.chat.completions.create(model="policy", messages=messages, temperature=0.7)  # type: ignore[arg-type]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert first.model == "policy" and call.function.name == "calculator"  # type: ignore[union-attr]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
        assert second.choices[0].message.content == "Answer: 5"
        root = opened["base_url"].removesuffix("/v1")
        assert httpx.post(f"{root}/reward", json={"reward": 1.0}, headers=admin).status_code == 200
        closed = httpx.post(f"{root}/close", headers=admin).json()
        assert closed["calls"] == 2 and closed["reward"] == 1.0 and len(closed["trajectories"]) == 1
        assert httpx.post(f"{opened['base_url']}/chat/completions", json={"messages": messages},
                          headers={"Authorization": f"Bearer {opened['api_key']}"}).status_code == 409
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    store = TrajectoryStore(run_dir / "trajectories.sqlite")
    [record] = list(store.iter_records())
    traj = record.trajectory
    assert traj.id == closed["trajectories"][0] and traj.reward == 1.0 and traj.task == {"id": "t1", "question": "2 + 3"}
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert len(traj.turns) == 2 and json.dumps(traj.info["gateway"])
    store.close()
