"""The inspector on a real run's store (Chromium + Playwright): what a user sees after the README's main job.

The run (`calculator_run`) is the calculator example trained for a few steps on SmolLM2-135M: every
prompt holds a system prompt, two worked demonstrations (a question, a calculator call, its result,
an answer) and then the task. Each test here fails on the inspector this issue fixed (#23): list rows
that previewed the first demonstration and counted its turns and calls, demonstrations numbered as
model turns, and an overview that opened on alphabetical metrics.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.store.trajectory_store import STORE_FILENAME
from agentrl.types import Trajectory

expect: Any = pytest.importorskip("playwright.sync_api").expect

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def real_server(calculator_run: Path, serve_store: Any) -> Iterator[str]:
    with serve_store(calculator_run / STORE_FILENAME) as url:
        yield url


@pytest.fixture(scope="module")
def trained(calculator_run: Path) -> dict[str, Trajectory]:
    with TrajectoryQueries.open(calculator_run) as q:
        ids = [str(r["id"]) for r in q.query(TrajectoryFilter(status="trained"), order="oldest", limit=1000)]
        return {i: q.store.get_trajectory(i) for i in ids}


def _words(text: str) -> str:
    return " ".join(text.split())


def test_list_previews_the_task_and_counts_the_episode(
    real_server: str, page: Any, trained: dict[str, Trajectory], calculator_run: Path
) -> None:
    page.goto(real_server + "/#/list?status=trained&order=oldest")
    page.wait_for_selector("#traj-table tbody tr")
    rows = page.locator("#traj-table tbody tr")
    assert rows.count() == len(trained) == 2 * 2 * 4
    previews: dict[str, str] = {}
    for k in range(rows.count()):
        row = rows.nth(k)
        traj = trained[row.get_attribute("data-id")]
        turns, calls = (
            int(row.locator("td.turns").text_content()),
            int(row.locator("td.calls").text_content()),
        )
        # what the rollout metrics count for this episode (rollout/turns_mean, rollout/tool_calls/*)
        assert turns == len(traj.turns) <= 3
        assert calls == sum(len(turn.tool_calls) for turn in traj.turns)
        preview = row.locator("td.preview").text_content()
        demo = traj.messages[1]
        assert demo.role == "user" and _words(demo.content) not in preview  # the first demonstration
        assert preview.startswith(_words(str(traj.task["prompt"]))), (preview, traj.task["prompt"])
        previews[traj.task_id] = preview.split(" ⟶ ")[0]
    assert len(set(previews.values())) == len(previews) >= 2  # one distinct question per task

    # over the run, the store's episodes have the rollout's turns per episode (windows differ from steps)
    rows_m = [json.loads(line) for line in (calculator_run / "metrics.jsonl").read_text().splitlines()]
    windows = [(r["rollout/episodes"], r["rollout/turns_mean"]) for r in rows_m if r.get("rollout/episodes")]
    rollout_mean = sum(n * m for n, m in windows) / sum(n for n, _ in windows)
    stored_mean = sum(len(t.turns) for t in trained.values()) / len(trained)
    assert abs(stored_mean - rollout_mean) < 0.5, (stored_mean, rollout_mean)

    # full-text search: the task's question is found, the demonstrations (in every prompt) are not
    some = next(iter(trained.values()))
    page.fill("input[name=search]", _words(some.messages[1].content))
    page.press("input[name=search]", "Enter")
    expect(page.locator("#match-count")).to_have_text("0 matching")
    page.fill("input[name=search]", _words(str(some.task["prompt"])))
    page.press("input[name=search]", "Enter")
    page.wait_for_selector(f"#traj-table tbody tr[data-id='{some.id}']")
    assert not page.console_errors, page.console_errors


def test_conversation_shows_the_prompt_as_the_prompt(
    real_server: str, page: Any, trained: dict[str, Trajectory]
) -> None:
    traj = next(t for t in trained.values() if any(turn.tool_calls for turn in t.turns))
    assert traj.prompt_messages is not None
    page.goto(real_server + f"/#/t/{traj.id}")
    page.wait_for_selector("#conversation .msg")
    demos = page.locator("#demonstrations")
    assert demos.evaluate("el => el.tagName") == "DETAILS" and demos.get_attribute("open") is None
    assert "2 worked examples" in demos.locator("summary").text_content()
    assert not demos.locator(".msg").first.is_visible()  # collapsed by default
    assert demos.locator(".turn-badge").count() == 0
    badges = page.locator("#conversation .turn-badge")
    assert badges.count() == len(traj.turns)
    assert badges.first.text_content().startswith("turn 0 · reward")
    first_turn = page.locator("#conversation > .msg.assistant").first
    assert first_turn.get_attribute("data-part") == "episode"
    first_reply = traj.messages[traj.prompt_messages]
    assert first_reply.role == "assistant"
    assert first_turn.locator("pre.content").text_content() == first_reply.content
    assert page.locator(".msg.user[data-part=task] pre.content").text_content() == traj.task["prompt"]

    n = len(traj.turns)
    assert page.locator("#play-label").text_content() == f"all {n} turn{'' if n == 1 else 's'}"
    page.click("#play-first")
    assert page.locator("#conversation .msg[data-part=episode]:visible").count() == 0
    assert page.locator("#conversation .msg[data-part=task]").is_visible()
    page.click("#play-next")
    assert page.locator("#play-label").text_content() == f"turn 1 of {n}" or n == 1
    assert page.locator("#conversation .msg.current .turn-badge").text_content().startswith("turn 0")

    demos.locator("summary").click()
    cards = demos.locator(".msg")
    assert cards.count() == traj.prompt_messages - 2 and cards.first.is_visible()
    assert cards.first.locator(".prompt-badge").text_content() == "prompt · demonstration"

    # the token view still colours by the loss mask alone: prompt (demonstrations included) vs sampled
    page.click("#tab-tokens")
    page.wait_for_selector("#tokens span.tok")
    colours = page.eval_on_selector_all("#tokens span.tok", "els => els.map(e => e.style.background)")
    assert {c for c, m in zip(colours, traj.loss_mask, strict=True) if m} == {"rgb(207, 227, 255)"}
    assert {c for c, m in zip(colours, traj.loss_mask, strict=True) if not m} == {"rgb(240, 240, 240)"}
    assert not page.console_errors, page.console_errors


def test_overview_opens_on_reward_with_held_out_reward(
    real_server: str, page: Any, calculator_run: Path
) -> None:
    page.goto(real_server + "/")
    page.wait_for_selector("#charts .chart svg path.line")
    first = page.locator(".chart").first
    assert first.get_attribute("data-metric") == "reward"
    assert first.locator("h3").text_content() == "reward: training vs held-out"
    keys = first.locator(".series-legend .series").evaluate_all("els => els.map(e => e.dataset.key)")
    assert keys == ["reward/mean", "eval/reward_mean"]
    assert first.locator("path.line").evaluate_all("els => els.map(e => e.dataset.key)") == keys
    headline = page.locator("#charts > .chart").evaluate_all("els => els.map(e => e.dataset.metric)")
    assert headline == ["reward", "success", "mismatch", "entropy", "length", "throughput", "staleness", "memory"]

    rows = [json.loads(line) for line in (calculator_run / "metrics.jsonl").read_text().splitlines()]
    constant = {k for k in rows[-1] if len({r[k] for r in rows if k in r}) == 1} - {"step", "time"}
    assert "autocast_bf16" in constant
    shown = page.locator("#constants .const").evaluate_all("els => els.map(e => e.dataset.key)")
    for key in constant:
        assert page.locator(f".chart[data-metric='{key}']").count() == 0, key
    assert "autocast_bf16" in shown
    prefixes = page.locator("section.metric-group").evaluate_all("els => els.map(e => e.dataset.prefix)")
    assert (
        prefixes[0] == "trajectories"
        and "off_policy" in prefixes
        and prefixes == [prefixes[0], *sorted(prefixes[1:], key=lambda p: (p != "step", p))]
    )
    assert not page.console_errors, page.console_errors
