"""A multi-policy run in the replay (#33 item 5): which policy spoke each turn, the list filtered by
policy, each policy's curves on shared charts.

The store is written through `TrajectoryStore` with real `Trajectory` objects, as a multi-policy run
writes them (agentrl.rollout.multi_agent, agentrl.run.policies): every model turn names its policy
(`Turn.policy`), a game's trajectories carry `info["agent"]`, `info["policy"]`, `info["outcome"]`,
training metrics are `policy/<name>/<key>` and held-out ones `eval/policy/<name>/<key>`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.replay.overview import overview_layout
from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.server import ReplaySettings, create_app
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
from agentrl.types import Group, Message, Trajectory, Turn

HOSTILE = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'
OUTCOMES = {"player_0": ["win", "loss", "draw"], "player_1": ["loss", "win", "draw"]}
SEATS = {"player_0": "alice", "player_1": "bob"}


def _tokens(tok: SimpleChatTokenizer, messages: list[Message], policies: list[str | None]) -> dict[str, Any]:
    """Token-exact lists for `messages`; the k-th assistant message is turn k, sampled by `policies[k]`."""
    ids: list[int] = []
    mask: list[int] = []
    turns: list[Turn] = []
    head = len(tok.encode("<|im_start|>assistant\n"))
    for m in messages:
        part = tok.encode(tok.render([m]))
        if m.role == "assistant":
            turns.append(Turn(start=len(ids) + head, end=len(ids) + len(part), policy=policies[len(turns)]))
            mask += [0] * head + [1] * (len(part) - head)
        else:
            mask += [0] * len(part)
        ids += part
    return {"token_ids": ids, "loss_mask": mask, "logprobs": [-0.5 if k else 0.0 for k in mask],
            "versions": [1 if k else -1 for k in mask], "turns": turns}  # fmt: skip


def game(tok: SimpleChatTokenizer, game_id: int, agent: str, *, hostile: bool = False) -> Trajectory:
    """One agent's trajectory of a two-player game (what `run_turns` yields per model-played agent)."""
    policy = SEATS[agent]
    outcome = OUTCOMES[agent][game_id % 3]
    move = f"I play square {game_id % 9}" + (f" {HOSTILE}" if hostile else "")
    messages = [
        Message("system", "You play tic-tac-toe."),
        Message("user", f"Game {game_id}: you are {agent}. Your move."),
        Message("assistant", move),
        Message("user", "The other player moved. Your turn."),
        Message("assistant", f"I play square {(game_id + 4) % 9}"),
    ]
    reward = {"win": 1.0, "loss": -1.0, "draw": 0.0}[outcome]
    return Trajectory(
        id=f"g{game_id}-{agent}", task_id=f"game-{game_id}", env="tictactoe", messages=messages,
        **_tokens(tok, messages, [policy, policy]), reward=reward, terminated=True, group_id=f"game-{game_id}",
        prompt_messages=2, task={"id": f"game-{game_id}"},
        info={"agent": agent if not hostile else f"{agent}{HOSTILE}", "policy": policy, "outcome": outcome},
    )  # fmt: skip


def planner_worker(tok: SimpleChatTokenizer, index: int) -> Trajectory:
    """A gateway trajectory whose turns two policies sampled (a planner and a worker, no agent ids)."""
    messages = [
        Message("user", f"Plan and solve task {index}."),
        Message("assistant", "Plan: add the numbers."),
        Message("user", "Worker, go."),
        Message("assistant", f"Answer: {index + 1}"),
    ]
    tokens = _tokens(tok, messages, ["alice", "bob"])
    # the worker's answer was forced (constrained decoding); the label is model-side text: shown as text
    tokens["turns"][1].info["constrained"] = "tool_choice='required'" + (HOSTILE if index == 2 else "")
    return Trajectory(
        id=f"pw-{index}", task_id=f"task-{index}", env="calculator", messages=messages,
        **tokens, reward=1.0, terminated=True, group_id=f"pw-{index}", prompt_messages=1,
    )  # fmt: skip


def metrics(step: int) -> dict[str, float]:
    out = {"reward/mean": 0.1 * step, "loss": 1.0 / step, "policies/stepped": 2.0}
    for k, name in enumerate(("alice", "bob")):
        out |= {f"policy/{name}/loss": (1.0 + k) / step, f"policy/{name}/reward/mean": 0.2 * step - 0.1 * k,
                f"policy/{name}/lr": 1e-4}  # fmt: skip
    if step % 2 == 0:
        out |= {"eval/reward_mean": 0.05 * step, "eval/policy/alice/win_rate": 0.1 * step,
                "eval/policy/bob/win_rate": 0.5 - 0.1 * step, "eval/policy/alice/draw_rate": 0.05 * step,
                "eval/policy/bob/draw_rate": 0.1, "eval/policy/alice/reward_mean": 0.2 * step - 0.5,
                "eval/policy/bob/reward_mean": 0.1}  # fmt: skip
    return out


def build_policy_run(run_dir: Path) -> None:
    tok = SimpleChatTokenizer()
    with TrajectoryStore(run_dir) as store:
        store.set_run_config({
            "run": {"name": "selfplay-test"}, "model": {"path": "synthetic"}, "replay": {"tokenizer": "simple"},
            "policies": {"alice": {"train": True}, "bob": {"train": True},
                         "random": {"train": False, "opponent": "random"}},
            "agents": SEATS,
        })  # fmt: skip
        for step in range(1, 5):
            for g in range(3):
                game_id = 3 * (step - 1) + g
                trajs = [game(tok, game_id, agent, hostile=game_id == 0) for agent in SEATS]
                store.add_group(
                    Group(task_id=f"game-{game_id}", trajectories=trajs, id=f"game-{game_id}"), step=step
                )
            store.add_group(Group(task_id=f"task-{step}", trajectories=[planner_worker(tok, step)],
                                  id=f"pw-{step}"), step=step)  # fmt: skip
            store.add_metrics(step, metrics(step))
        # a trajectory of no policy (e.g. an episode that failed before its first turn)
        empty = Trajectory(task_id="game-x", env="tictactoe", messages=[Message("user", "start")], token_ids=[1],
                           loss_mask=[0], logprobs=[0.0], versions=[-1], id="no-turns", group_id="x")  # fmt: skip
        store.add_trajectory(empty, step=4, status="dropped")


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("policy-run")
    build_policy_run(run_dir)
    return run_dir


# --------------------------------------------------------------------------- queries


def test_filter_by_policy_uses_the_index_and_matches_turns_or_seat(policy_run: Path) -> None:
    with TrajectoryQueries.open(policy_run) as q:
        assert q.distinct("policy") == ["alice", "bob"]
        alice = {str(r["id"]) for r in q.query(TrajectoryFilter(policy="alice"), limit=1000)}
        bob = {str(r["id"]) for r in q.query(TrajectoryFilter(policy="bob"), limit=1000)}
        games = {f"g{i}-{a}" for i in range(12) for a in SEATS}
        mixed = {f"pw-{s}" for s in range(1, 5)}
        assert alice == {g for g in games if g.endswith("player_0")} | mixed
        assert bob == {g for g in games if g.endswith("player_1")} | mixed
        assert (
            q.count(TrajectoryFilter(policy="alice")) == 16
            and q.count(TrajectoryFilter(policy="random")) == 0
        )
        assert q.count() == 12 * 2 + 4 + 1  # "no-turns" is of no policy
        # with other filters, pages and orders
        page, cursor = q.page(
            TrajectoryFilter(policy="bob", env="tictactoe", reward_min=0.5), order="oldest", limit=2
        )
        assert [r["id"] for r in page] == ["g1-player_1", "g4-player_1"] and cursor is not None
        rest, _ = q.page(
            TrajectoryFilter(policy="bob", env="tictactoe", reward_min=0.5), order="oldest", cursor=cursor
        )
        assert [r["id"] for r in rest] == ["g7-player_1", "g10-player_1"]
        rows = {str(r["id"]): r for r in q.query(limit=1000)}
        assert rows["pw-1"]["policies"] == ["alice", "bob"] and rows["g3-player_1"]["policies"] == ["bob"]
        assert rows["no-turns"]["policies"] == []
        # an index lookup, not a scan of the documents
        where, args = TrajectoryFilter(policy="alice").where()
        plan = " ".join(str(r[-1]) for r in q.store.read(f"EXPLAIN QUERY PLAN SELECT seq FROM trajectories t "
                                                           f"WHERE {where}", args))  # fmt: skip
        assert "traj_policies" in plan and "trajectory_data" not in plan, plan


def test_single_policy_rows_have_no_policies(tmp_path: Path) -> None:
    tok = SimpleChatTokenizer()
    t = planner_worker(tok, 1)
    for turn in t.turns:
        turn.policy = None
    with TrajectoryStore(tmp_path) as store:
        store.add_trajectory(t, step=1, status="trained")
    with TrajectoryQueries.open(tmp_path) as q:
        assert q.distinct("policy") == [] and q.query()[0]["policies"] == []
        assert q.count(TrajectoryFilter(policy="alice")) == 0


def _drop_policies_table(path: Path) -> None:
    """Make `path` look written by agentrl before `traj_policies` existed (same schema version)."""
    db = sqlite3.connect(path)
    db.execute("DROP TABLE traj_policies")
    db.commit()
    db.close()


def test_an_older_store_without_the_policies_table_reads_and_upgrades(
    policy_run: Path, tmp_path: Path
) -> None:
    old = tmp_path / STORE_FILENAME
    db = sqlite3.connect(policy_run / STORE_FILENAME)
    db.execute("VACUUM INTO ?", (str(old),))
    db.close()
    _drop_policies_table(old)
    with TrajectoryQueries.open(old) as q:  # read-only: the documents answer, the same answers
        assert q.distinct("policy") == ["alice", "bob"]
        assert q.count(TrajectoryFilter(policy="alice")) == 16
        assert {str(r["id"]) for r in q.query(TrajectoryFilter(policy="bob", env="calculator"))} == {
            f"pw-{s}" for s in range(1, 5)
        }
        assert q.query(TrajectoryFilter(group_id="pw-2"))[0]["policies"] == ["alice", "bob"]
    with TrajectoryStore(old) as store:  # opened for writing once: the table is made and filled
        assert store.integrity_check() == "ok"
    with TrajectoryQueries.open(old) as q, TrajectoryQueries.open(policy_run) as new:
        assert q.store.read("SELECT policy, seq FROM traj_policies ORDER BY 1, 2") == new.store.read(
            "SELECT policy, seq FROM traj_policies ORDER BY 1, 2"
        )
        assert q.count(TrajectoryFilter(policy="alice")) == 16


# --------------------------------------------------------------------------- overview


def test_overview_draws_one_series_per_policy_on_shared_charts(policy_run: Path) -> None:
    with TrajectoryQueries.open(policy_run) as q:
        layout = overview_layout(q.store.metrics(), q.step_rewards())
    ids = [c["id"] for c in layout["headline"]]
    assert ids[:3] == ["reward", "policy-win-rate", "policy-reward"]
    win = layout["headline"][1]
    assert [(s["label"], s["key"], s["colour"]) for s in win["series"]] == [
        ("alice", "eval/policy/alice/win_rate", 0), ("bob", "eval/policy/bob/win_rate", 1)]  # fmt: skip
    assert win["series"][0]["points"] == [[2, 0.2], [4, 0.4]]
    assert win["series"][1]["points"] == [[2, pytest.approx(0.3)], [4, pytest.approx(0.1)]]
    reward = layout["headline"][2]
    assert [s["key"] for s in reward["series"]] == ["policy/alice/reward/mean", "policy/bob/reward/mean"]
    group = next(g for g in layout["groups"] if g["prefix"] == "policy")
    charts = {c["id"]: c for c in group["charts"]}
    assert set(charts) == {"policy/*/loss", "eval/policy/*/draw_rate", "eval/policy/*/reward_mean"}
    assert [s["label"] for s in charts["policy/*/loss"]["series"]] == ["alice", "bob"]
    # bob's draw rate never changes but alice's does: still one shared chart, bob keeps his colour
    assert [s["colour"] for s in charts["eval/policy/*/draw_rate"]["series"]] == [0, 1]
    assert [g["prefix"] for g in layout["groups"]][:2] == ["trajectories", "step"]
    # no per-policy metric is drawn a second time on a chart of its own
    assert all(
        "policy/" not in c["id"] for g in layout["groups"] if g["prefix"] != "policy" for c in g["charts"]
    )
    constants = dict(layout["constants"])
    assert constants["policy/alice/lr"] == 1e-4 and constants["policy/bob/lr"] == 1e-4


def test_a_single_policy_overview_is_unchanged() -> None:
    rows = [(s, {"reward/mean": 0.1 * s, "loss": 1.0 / s, "eval/reward_mean": 0.2 * s}) for s in (1, 2, 3)]
    layout = overview_layout(rows, [])
    assert [c["id"] for c in layout["headline"]] == ["reward"]
    assert all("colour" not in s for c in layout["headline"] for s in c["series"])
    assert [g["prefix"] for g in layout["groups"]] == ["step"]


# --------------------------------------------------------------------------- HTTP API


@pytest.fixture
async def client(policy_run: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(ReplaySettings(policy_run / STORE_FILENAME))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def get_json(client: TestClient[Any, Any], path: str, status: int = 200) -> Any:
    resp = await client.get(path)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def test_api_lists_policies_and_filters_by_them(client: TestClient[Any, Any]) -> None:
    run = await get_json(client, "/api/run")
    assert run["filters"]["policy"] == ["alice", "bob", "random"]  # the config's, a fixed opponent too
    page = await get_json(client, "/api/trajectories?policy=bob&env=tictactoe&limit=100")
    assert {r["id"] for r in page["items"]} == {f"g{i}-player_1" for i in range(12)}
    assert all(r["policies"] == ["bob"] for r in page["items"])
    assert (await get_json(client, "/api/count?policy=alice"))["count"] == 16
    assert (await get_json(client, "/api/count?policy=nobody"))["count"] == 0
    assert (await get_json(client, "/api/count?policy="))["count"] == 29  # empty: no filter
    group = await get_json(client, "/api/groups/game-1")
    seats = {m["id"]: (m["agent"], m["outcome"], m["policies"]) for m in group["members"]}
    assert seats == {
        "g1-player_0": ("player_0", "loss", ["alice"]),
        "g1-player_1": ("player_1", "win", ["bob"]),
    }
    traj = (await get_json(client, "/api/trajectories/pw-1"))["trajectory"]
    assert [t.get("policy") for t in traj["turns"]] == ["alice", "bob"]


async def test_api_metrics_layout_has_the_per_policy_series(client: TestClient[Any, Any]) -> None:
    data = await get_json(client, "/api/metrics")
    win = next(c for c in data["layout"]["headline"] if c["id"] == "policy-win-rate")
    assert {s["label"]: s["points"][-1][1] for s in win["series"]} == {
        "alice": 0.4,
        "bob": pytest.approx(0.1),
    }


async def test_single_policy_run_lists_no_policies(replay_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(replay_run)
    app = create_app(ReplaySettings(replay_run / STORE_FILENAME))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        run = await get_json(c, "/api/run")
        assert run["filters"]["policy"] == []
        page = await get_json(c, "/api/trajectories?limit=5")
        assert all(r["policies"] == [] for r in page["items"])


# --------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def policy_server(policy_run: Path, serve_store: Any) -> Iterator[str]:
    with serve_store(policy_run / STORE_FILENAME) as url:
        yield url


@pytest.mark.browser
def test_browser_shows_policies_filters_and_per_policy_charts(policy_server: str, page: Any) -> None:
    expect: Any = pytest.importorskip("playwright.sync_api").expect
    page.goto(policy_server + "/")
    page.wait_for_selector("#charts .chart[data-metric=policy-win-rate] svg path.line")
    titles = page.locator("#charts .chart h3").all_text_contents()
    assert titles[:3] == [
        "reward: training vs held-out",
        "held-out win rate per policy",
        "training reward per policy",
    ]
    win = page.locator(".chart[data-metric=policy-win-rate]")
    assert win.locator(".series-legend .series").all_text_contents() == ["alice", "bob"]
    assert win.locator("path.line").count() == 2
    assert [win.locator("path.line").nth(i).get_attribute("data-key") for i in range(2)] == [
        "eval/policy/alice/win_rate", "eval/policy/bob/win_rate"]  # fmt: skip
    # a policy keeps its colour on every chart
    loss = page.locator(".chart[data-metric='policy/*/loss']")
    assert loss.locator("path.line.s1").get_attribute("data-key") == "policy/bob/loss"
    assert win.locator("path.line.s1").get_attribute("data-key") == "eval/policy/bob/win_rate"

    page.click("#nav-list")
    page.wait_for_selector("#traj-table tbody tr")
    assert page.locator("select[name=policy] option").all_text_contents() == ["any", "alice", "bob", "random"]
    expect(page.locator("#match-count")).to_have_text("29 matching")
    page.select_option("select[name=policy]", "bob")
    page.select_option("select[name=env]", "calculator")
    page.click("#apply")
    expect(page.locator("#match-count")).to_have_text("4 matching")
    assert "policy=bob" in page.url
    assert set(page.locator("#traj-table tbody td.policies").all_text_contents()) == {"alicebob"}

    page.goto(policy_server + "/#/t/pw-2")
    page.wait_for_selector("#conversation .msg.assistant")
    labels = page.locator("#conversation .msg.assistant .turn-policy").all_text_contents()
    assert labels == ["alice", "bob"]
    badges = page.locator("#conversation .msg.assistant").nth(1).locator(".constrained-badge")
    assert badges.all_text_contents() == [f"constrained · tool_choice='required'{HOSTILE}"]
    assert page.locator("#conversation .msg.assistant").first.locator(".constrained-badge").count() == 0
    page.wait_for_timeout(150)
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("#traj-policies .policy-badge").all_text_contents() == ["alice", "bob"]
    assert page.locator("#traj-agent").count() == 0 and page.locator("#traj-outcome").count() == 0

    page.goto(policy_server + "/#/t/g4-player_1")
    page.wait_for_selector("h2:has-text('Trajectory g4-player_1')")
    assert page.locator("#conversation .turn-policy").all_text_contents() == ["bob · player_1"] * 2
    assert page.locator("#traj-agent").text_content() == "agentplayer_1"
    assert page.locator("#traj-outcome .badge").text_content() == "win"

    # the agent id and the model's move are text, not markup
    page.goto(policy_server + "/#/t/g0-player_0")
    page.wait_for_selector("h2:has-text('Trajectory g0-player_0')")
    page.wait_for_timeout(150)
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("main img").count() == 0 and page.locator("script").count() == 1
    assert HOSTILE in page.locator("#conversation .turn-policy").first.text_content()
    assert HOSTILE in page.locator("#conversation .msg.assistant .content").first.text_content()
    assert page.locator("#traj-outcome .badge").text_content() == "win"
    page.click("#tab-group")
    page.wait_for_selector("#siblings .sibling")
    assert page.locator("#siblings .sibling .seat").all_text_contents() == [
        f"alice player_0{HOSTILE}win", f"bob player_1{HOSTILE}loss"]  # fmt: skip
    assert not page.console_errors, page.console_errors


def test_doc_policies_reads_what_the_store_writes(policy_run: Path) -> None:
    from agentrl.store.schema import doc_policies, trajectory_policies

    with TrajectoryStore(policy_run, readonly=True) as store:
        for record in store.iter_records():
            doc = json.loads(json.dumps(record.trajectory.to_dict()))
            assert doc_policies(doc) == trajectory_policies(record.trajectory)
