"""The replay HTTP API: data, filters, pagination, tokens, groups, re-execution, security."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.server import ReplaySettings, create_app, settings_for_bind
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
from agentrl.types import Message, Trajectory


def _files_digest(run: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(run.glob(STORE_FILENAME + "*")):
        if not p.name.endswith("-shm"):  # the shared-memory index is not data
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture
async def client(replay_run: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient[Any, Any]]:
    monkeypatch.chdir(replay_run)  # the run config's plugin module imports from the cwd
    app = create_app(ReplaySettings(replay_run / STORE_FILENAME))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def get_json(client: TestClient[Any, Any], path: str, status: int = 200) -> Any:
    resp = await client.get(path)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def test_page_and_static_files_have_strict_headers(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/")
    assert resp.status == 200
    assert "text/html" in resp.headers["Content-Type"]
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    html = await resp.text()
    assert '<script src="/static/app.js"' in html and "http" not in html.split("<body>")[0].replace(
        "http-equiv", ""
    )
    js = await client.get("/static/app.js")
    assert js.status == 200 and "javascript" in js.headers["Content-Type"]
    source = await js.text()
    assert "innerHTML" not in source.replace(
        "no innerHTML", ""
    ) and "insertAdjacentHTML" not in source.replace("no insertAdjacentHTML", "")
    assert (await client.get("/static/app.css")).status == 200


async def test_run_and_metrics(client: TestClient[Any, Any], replay_run: Path) -> None:
    run = await get_json(client, "/api/run")
    assert run["count"] == 6 * 5 * 4 + 1 + 2 + 1
    assert run["config"]["run"]["name"] == "replay-test"
    assert run["filters"]["env"] == ["calculator", "mul", "python_sandbox", "search_qa"]
    assert "python" in run["filters"]["tool"] and "tool" in run["filters"]["error_class"]
    metrics = await get_json(client, "/api/metrics")
    assert [m["step"] for m in metrics["metrics"]] == [1, 2, 3, 4, 5, 6]
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3, 4, 5, 6]
    assert metrics["steps"][0]["count"] == 21  # 20 synthetic + the stats-less copy


async def test_list_filters_and_cursor_pages_match_the_store(
    client: TestClient[Any, Any], replay_run: Path
) -> None:
    with TrajectoryQueries.open(replay_run) as q:
        want = [
            r["id"] for r in q.query(TrajectoryFilter(env="python_sandbox"), order="reward_desc", limit=1000)
        ]
    got: list[str] = []
    cursor = ""
    while True:
        page = await get_json(
            client, f"/api/trajectories?env=python_sandbox&order=reward_desc&limit=9&cursor={cursor}"
        )
        got += [r["id"] for r in page["items"]]
        if not page["next_cursor"]:
            break
        cursor = page["next_cursor"]
    assert got == want and len(got) > 9
    count = await get_json(client, "/api/count?env=python_sandbox")
    assert count["count"] == len(want)
    searched = await get_json(client, "/api/trajectories?search=ZeroDivisionError&tool=python&limit=200")
    assert searched["items"] and all("python" in r["tools"] for r in searched["items"])
    bad = await get_json(client, "/api/trajectories?reward_min=high", status=400)
    assert "reward_min='high'" in bad["error"]
    bad = await get_json(client, "/api/trajectories?order=random", status=400)
    assert "order='random'" in bad["error"]


async def test_trajectory_payload_and_token_view(client: TestClient[Any, Any], replay_run: Path) -> None:
    with TrajectoryQueries.open(replay_run) as q:
        row = q.query(TrajectoryFilter(env="python_sandbox", error="none"), limit=1)[0]
        traj = q.store.get_trajectory(str(row["id"]))
    data = await get_json(client, f"/api/trajectories/{traj.id}")
    assert data["trajectory"]["id"] == traj.id and data["status"] in ("trained", "dropped")
    assert data["trajectory"]["messages"] == [m.to_dict() for m in traj.messages]
    tok = data["tokens"]
    assert tok["tokenizer"] == "simple"
    assert tok["ids"] == traj.token_ids and tok["loss_mask"] == traj.loss_mask
    assert "".join(tok["text"]).replace("\ufffd", "") != ""
    # byte tokens decode one by one; special tokens by name: the text is the rendered conversation
    assert "".join(tok["text"]) == SimpleChatTokenizer().decode(traj.token_ids)
    stats = traj.info["token_stats"]
    assert tok["trainer_logprobs"] == pytest.approx(stats["trainer_logprobs"])
    assert tok["advantages"] == pytest.approx(stats["advantages"])
    assert tok["is_weights"] == pytest.approx(stats["is_weights"])
    assert [t for t, m in zip(tok["turn"], traj.loss_mask, strict=True) if m] == sorted(
        t for t, m in zip(tok["turn"], traj.loss_mask, strict=True) if m
    )
    bare = await get_json(client, "/api/trajectories/no-stats")
    assert bare["tokens"]["trainer_logprobs"] is None and bare["tokens"]["advantages"] is None
    assert (await get_json(client, "/api/trajectories/nope", status=404))["error"]


async def test_group_view(client: TestClient[Any, Any], replay_run: Path) -> None:
    with TrajectoryQueries.open(replay_run) as q:
        gid = str(q.query(TrajectoryFilter(env="search_qa"), limit=1)[0]["group_id"])
    data = await get_json(client, f"/api/groups/{gid}")
    assert [m["sample_index"] for m in data["members"]] == [0, 1, 2, 3]
    assert data["group"]["size"] == 4
    assert all(m["advantage"] is not None and "final" in m for m in data["members"])
    await get_json(client, "/api/groups/missing", status=404)


async def test_reexecution_reproduces_and_flags_tampering(
    client: TestClient[Any, Any], replay_run: Path
) -> None:
    before = _files_digest(replay_run)
    headers = {"X-Agentrl-Request": "check"}
    ok = await (await client.post("/api/trajectories/mul-ok/check", headers=headers)).json()
    assert ok["ok"] is True, ok
    assert ok["observations_ok"] and ok["reward_ok"] and ok["reward_replayed"] == 1.5
    assert [s["ok"] for s in ok["steps"]] == [True, True, True]
    bad = await (await client.post("/api/trajectories/mul-bad/check", headers=headers)).json()
    assert bad["ok"] is False and not bad["observations_ok"] and not bad["reward_ok"]
    turn0 = bad["steps"][1]
    assert turn0["turn"] == 0 and not turn0["ok"]
    assert turn0["stored"][0]["content"] == "41" and turn0["replayed"][0]["content"] == "42"
    # a trajectory whose env no plugin provides: a clear error naming it, not a crash
    search_qa = (await get_json(client, "/api/trajectories?env=search_qa&limit=1"))["items"][0]["id"]
    synthetic = await (await client.post(f"/api/trajectories/{search_qa}/check", headers=headers)).json()
    assert synthetic["ok"] is False and "search_qa" in synthetic["error"]
    assert _files_digest(replay_run) == before  # re-execution wrote nothing


@pytest.mark.parametrize(
    "path",
    [
        "/static/../store.py",
        "/static/%2e%2e/server.py",
        "/static/..%2fserver.py",
        "/static/app.js/../../cli.py",
        "/static/%2e%2e%2f%2e%2e%2fstore.py",
        "//etc/passwd",
        "/static//etc/passwd",
        "/../../../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/static/index.html",
        "/static/synthetic.py",
        "/api/trajectories/..%2f..%2f..%2fetc%2fpasswd",
        "/api/groups/../../etc/passwd",
        "/trajectories.sqlite",
        "/static/trajectories.sqlite",
    ],
)
async def test_no_path_traversal(client: TestClient[Any, Any], path: str) -> None:
    status, body = await raw_get(client, path)
    assert status in (404, 400), (path, status)
    for leak in (b"root:", b"import ", b"SQLite format", b"def "):
        assert leak not in body


async def raw_get(client: TestClient[Any, Any], path: str) -> tuple[int, bytes]:
    """Send the path byte for byte (an HTTP client library would normalise `..` away)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", client.port), 10)
    host = f"127.0.0.1:{client.port}"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(data.split(b" ", 2)[1]), data


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/api/run", {}, 403),
        ("POST", "/api/run", {"X-Agentrl-Request": "check"}, 405),
        ("PUT", "/api/trajectories/mul-ok", {}, 405),
        ("DELETE", "/api/trajectories/mul-ok", {}, 405),
        ("PATCH", "/api/run", {}, 405),
        ("POST", "/", {"X-Agentrl-Request": "check"}, 405),
        ("PUT", "/static/app.js", {}, 405),
        ("POST", "/api/trajectories/mul-ok/check", {}, 403),  # a cross-site form cannot set the header
        ("POST", "/api/trajectories/mul-ok/check", {"X-Agentrl-Request": "yes"}, 403),
    ],
)
async def test_read_only(
    client: TestClient[Any, Any],
    replay_run: Path,
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
) -> None:
    before = _files_digest(replay_run)
    resp = await client.request(method, path, headers=headers, data=b'{"id": "x"}')
    assert resp.status == status
    assert _files_digest(replay_run) == before


async def test_loopback_bind_pins_the_host_header(replay_run: Path) -> None:
    settings = settings_for_bind(replay_run / STORE_FILENAME, "127.0.0.1", 0)
    assert settings.token is None
    async with TestClient(TestServer(create_app(settings), host="127.0.0.1")) as c:
        port = c.port
        settings.allowed_hosts = (f"127.0.0.1:{port}", f"localhost:{port}")
        assert (await c.get("/api/run")).status == 200
        assert (await c.get("/api/run", headers={"Host": f"localhost:{port}"})).status == 200
        rebind = await c.get("/api/run", headers={"Host": f"evil.example:{port}"})
        assert rebind.status == 403


async def test_token_required_on_other_binds(replay_run: Path) -> None:
    settings = settings_for_bind(replay_run / STORE_FILENAME, "0.0.0.0", 0)
    token = settings.token
    assert token and len(token) >= 24 and settings.allowed_hosts is None
    assert settings_for_bind(replay_run / STORE_FILENAME, "0.0.0.0", 0).token != token  # random each time
    async with TestClient(TestServer(create_app(settings), host="127.0.0.1")) as c:
        for path in ("/", "/static/app.js", "/api/run", "/api/trajectories/mul-ok"):
            assert (await c.get(path)).status == 401, path
        assert (await c.get("/api/run?token=wrong")).status == 401
        assert (await c.get("/api/run", headers={"X-Agentrl-Token": token})).status == 200
        first = await c.get(f"/?token={token}", allow_redirects=False)
        assert first.status == 302 and first.headers["Location"] == "/"
        cookie = first.cookies["agentrl_replay_token"]
        assert cookie.value == token and cookie["httponly"] and cookie["samesite"] == "Strict"
        assert (await c.get("/api/run")).status == 200  # the cookie jar now carries it
        assert (await c.get("/")).status == 200


async def test_live_reads_while_a_writer_commits(tmp_path: Path) -> None:
    writer = TrajectoryStore(tmp_path, commit_every=2, commit_interval_s=3600)
    t = Trajectory(task_id="t", env="e", messages=[Message("user", "hi")], token_ids=[1], loss_mask=[0],
                   logprobs=[0.0], versions=[-1], id="a")  # fmt: skip
    writer.add_trajectory(t, step=1, status="trained")
    writer.commit()
    async with TestClient(TestServer(create_app(ReplaySettings(writer.path)), host="127.0.0.1")) as c:
        assert (await get_json(c, "/api/run"))["count"] == 1
        for i in range(3):
            writer.add_trajectory(
                Trajectory.from_dict({**t.to_dict(), "id": f"b{i}"}), step=2, status="trained"
            )
        assert (await get_json(c, "/api/run"))["count"] == 3  # one committed batch of 2; 1 pending
        writer.commit()
        assert (await get_json(c, "/api/run"))["count"] == 4
        assert (await get_json(c, "/api/trajectories/b2"))["trajectory"]["id"] == "b2"
    writer.close()


def test_cli_non_loopback_prints_a_token_and_requires_it(replay_run: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "replay", str(replay_run), "--host", "0.0.0.0", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"},
    )
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "access token" in line:
                break
        text = "".join(lines)
        url = re.search(r"http://\S+", text)
        token = re.search(r"access token: (\S+)", text)
        assert url and token, text
        port = int(re.search(r":(\d+)/", url.group(0)).group(1))  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/api/run", timeout=10)
        assert e.value.code == 401
        req = urllib.request.Request(f"{base}/api/run", headers={"X-Agentrl-Token": token.group(1)})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert f"token={token.group(1)}" in url.group(0)
    finally:
        proc.kill()
        proc.wait(timeout=30)
