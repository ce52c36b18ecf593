"""The replay single-page app in a real browser (Debian Chromium driven by Playwright).

Needs `.ci/setup_browser.sh` (apt chromium). Screenshots go to the test's tmp
dir (the docs' screenshots come from a real run: scripts/replay_screenshots.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.replay.queries import TrajectoryFilter, TrajectoryQueries
from agentrl.replay.synthetic import fill_store, synthetic_group
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore

expect: Any = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(replay_run: Path, mul_plugin_dir: Path, serve_store: Any) -> Iterator[str]:
    cwd = os.getcwd()
    os.chdir(mul_plugin_dir)  # re-execution imports the run's plugin module from the cwd
    try:
        with serve_store(replay_run / STORE_FILENAME) as url:
            yield url
    finally:
        os.chdir(cwd)


def shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"replay-{name}.png"
    page.screenshot(path=str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_overview_list_filter_and_open(server: str, page: Any, replay_run: Path, tmp_path: Path) -> None:
    page.goto(server + "/")
    page.wait_for_selector("#charts .chart svg path.line")
    assert page.locator("#run-name").text_content() == "replay-test"
    titles = page.locator(".chart h3").all_text_contents()
    assert titles[0] == "reward: training vs held-out" and "loss/policy" in titles
    shot(page, tmp_path, "overview")

    page.click("#nav-list")
    page.wait_for_selector("#traj-table tbody tr")
    assert page.locator("#traj-table tbody tr").count() == 50
    with TrajectoryQueries.open(replay_run) as q:
        total = q.count()
        n_python = q.count(TrajectoryFilter(env="python_sandbox", reward_min=1.0))
        zero = q.count(TrajectoryFilter(search="ZeroDivisionError"))
    assert page.locator("#match-count").text_content() == f"{total} matching"

    page.select_option("select[name=env]", "python_sandbox")
    page.fill("input[name=reward_min]", "1")
    page.click("#apply")
    expect(page.locator("#match-count")).to_have_text(f"{n_python} matching")
    envs = page.locator("#traj-table tbody tr td:nth-child(3)").all_text_contents()
    rewards = [float(x) for x in page.locator("#traj-table tbody tr td.reward").all_text_contents()]
    assert envs and set(envs) == {"python_sandbox"} and min(rewards) >= 1.0
    assert "env=python_sandbox" in page.url

    page.click("button:has-text('Reset')")
    expect(page.locator("#match-count")).to_have_text(f"{total} matching")
    page.fill("input[name=search]", "ZeroDivisionError")
    page.press("input[name=search]", "Enter")
    expect(page.locator("#match-count")).to_have_text(f"{zero} matching")
    shot(page, tmp_path, "list")

    first = page.locator("#traj-table tbody tr").first
    traj_id = first.get_attribute("data-id")
    first.click()
    page.wait_for_selector("#conversation .msg.assistant")
    assert traj_id in page.locator("h2").first.text_content()
    assert page.locator(".toolcall .name", has_text="python").count() >= 1
    assert page.locator(".sandbox pre.stderr", has_text="ZeroDivisionError").count() >= 1
    assert page.locator("#reward-breakdown td", has_text="correct").count() == 1
    shot(page, tmp_path, "conversation")
    assert not page.console_errors, page.console_errors


def test_playback_steps_turn_by_turn(server: str, page: Any) -> None:
    page.goto(server + "/#/t/mul-ok")
    page.wait_for_selector("#conversation .msg")
    visible = lambda: page.locator("#conversation .msg:visible").count()  # noqa: E731
    assert visible() == 4 and page.locator("#play-label").text_content() == "all 2 turns"
    page.click("#play-first")
    assert visible() == 1  # only the user's question
    page.click("#play-next")
    assert (
        visible() == 3 and page.locator("#play-label").text_content() == "turn 1 of 2"
    )  # call + tool output
    assert page.locator("#conversation .msg.current .toolcall .name").text_content() == "multiply"
    page.click("#play-next")
    assert visible() == 4
    page.click("#play-prev")
    page.click("#play-prev")
    assert visible() == 1
    page.click("#play-auto")
    expect(page.locator("#play-label")).to_have_text("all 2 turns", timeout=10_000)


def test_token_colourings_and_hover(server: str, page: Any, replay_run: Path, tmp_path: Path) -> None:
    with TrajectoryQueries.open(replay_run) as q:
        tid = str(q.query(TrajectoryFilter(env="calculator", status="trained", step_max=5), limit=1)[0]["id"])
        traj = q.store.get_trajectory(tid)
    page.goto(server + f"/#/t/{tid}")
    page.click("#tab-tokens")
    page.wait_for_selector("#tokens span.tok")
    spans = page.locator("#tokens span.tok")
    assert spans.count() == len(traj.token_ids)

    def backgrounds() -> list[str]:
        return page.eval_on_selector_all("#tokens span.tok", "els => els.map(e => e.style.background)")

    mask_colours = backgrounds()
    sampled = {c for c, m in zip(mask_colours, traj.loss_mask, strict=True) if m}
    prompt = {c for c, m in zip(mask_colours, traj.loss_mask, strict=True) if not m}
    assert len(sampled) == 1 and len(prompt) == 1 and sampled != prompt

    for field in ("logprobs", "trainer_logprobs", "is_weights", "advantages", "versions", "is_mask"):
        page.select_option("#colour-by", field)
        colours = backgrounds()
        assert all(c == "" for c, m in zip(colours, traj.loss_mask, strict=True) if not m), (
            field
        )  # n/a off-policy
        assert all(c != "" for c, m in zip(colours, traj.loss_mask, strict=True) if m), field
        if field in ("logprobs", "trainer_logprobs", "is_weights"):
            assert len({c for c, m in zip(colours, traj.loss_mask, strict=True) if m}) > 3, field
        assert page.locator("#token-notice").text_content() == ""
    page.select_option("#colour-by", "logprobs")
    k = traj.loss_mask.index(1) + 2
    spans.nth(k).hover()
    tip = page.locator("#tooltip")
    assert tip.is_visible()
    text = tip.text_content()
    assert f"#{k}" in text and f"id {traj.token_ids[k]}" in text
    assert f"{traj.logprobs[k]:.4f}" in text and "policy version" in text
    shot(page, tmp_path, "tokens")

    page.goto(server + "/#/t/no-stats?tab=tokens")
    page.wait_for_selector("#tokens span.tok")
    page.select_option("#colour-by", "trainer_logprobs")
    assert "n/a" in page.locator("#token-notice").text_content()
    assert all(c == "" for c in backgrounds())
    assert "(n/a)" in page.locator("#colour-by option[value=advantages]").text_content()


def test_group_view_side_by_side(server: str, page: Any, replay_run: Path, tmp_path: Path) -> None:
    with TrajectoryQueries.open(replay_run) as q:
        row = q.query(TrajectoryFilter(env="search_qa"), limit=1)[0]
        members = q.group_members(str(row["group_id"]))
    page.goto(server + f"/#/t/{row['id']}?tab=group")
    page.wait_for_selector("#siblings .sibling")
    cards = page.locator("#siblings .sibling")
    assert cards.count() == len(members) == 4
    for i, m in enumerate(members):
        card_text = cards.nth(i).text_content()
        assert f"reward {m['reward']:.3f}" in card_text or f"reward {int(m['reward'])}" in card_text
        assert "advantage" in card_text
    assert page.locator("#siblings .sibling.current").get_attribute("data-id") == row["id"]
    shot(page, tmp_path, "group")


def test_reexecute_button(server: str, page: Any) -> None:
    page.goto(server + "/#/t/mul-ok")
    page.click("#check")
    page.wait_for_selector("#check-verdict")
    assert page.locator("#check-verdict").text_content().startswith("✔ reproduces")
    page.goto(server + "/#/t/mul-bad")  # a hash change: the old view stays until the new one renders
    page.wait_for_selector("h2:has-text('Trajectory mul-bad')")
    page.click("#check")
    page.wait_for_selector("#check-verdict")
    assert "does not reproduce" in page.locator("#check-verdict").text_content()
    assert page.locator("#check-report summary.fail", has_text="turn 0").count() == 1


def test_hostile_model_text_renders_inert(server: str, page: Any) -> None:
    for view in ("/#/t/xss-traj", "/#/t/xss-traj?tab=tokens", "/#/t/xss-traj?tab=group", "/#/list?search=pwned",
                 "/#/list?env=calculator&order=oldest", "/#/g/xss-group"):  # fmt: skip
        page.goto(server + view)
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(150)
        assert page.evaluate("typeof window.__pwned") == "undefined", view
        assert page.dialogs == [], view
        assert page.locator("img").count() == 0, view
        assert page.locator("main svg[onload], main a[href^='javascript']").count() == 0, view
        assert page.locator("script").count() == 1, view  # only /static/app.js
    page.goto(server + "/#/t/xss-traj")
    page.wait_for_selector("#conversation .msg")
    text = page.locator("#conversation").text_content()
    assert "<script>window.__pwned = 1; alert('script')</script>" in text
    assert "<img src=x onerror=" in text
    assert page.locator("#episode-error").text_content().count("<img src=x") == 1
    assert page.locator(".toolcall .name").first.text_content().startswith("<img")
    page.goto(server + "/#/list?search=pwned")
    page.wait_for_selector("#traj-table tbody tr")
    assert "<script>" in page.locator("#traj-table").text_content()
    assert not page.console_errors, page.console_errors


def test_live_while_training_writes(page: Any, tmp_path: Path, serve_store: Any) -> None:
    writer = TrajectoryStore(tmp_path / "run", commit_every=1000, commit_interval_s=3600)
    fill_store(writer, steps=2, groups_per_step=2, group_size=2, seed=5)
    rng, tok = random.Random(9), SimpleChatTokenizer()

    def train_step(step: int) -> None:
        for index in range(2):
            group = synthetic_group(rng, step=step, index=100 * step + index, group_size=2, tokenizer=tok)
            writer.add_group(group, step=step, status="trained")
        writer.add_metrics(step, {"reward/mean": 0.5, "loss/policy": 0.0})
        writer.commit()

    try:
        with serve_store(writer.path) as url:
            page.goto(url + "/")
            expect(page.locator("#live-count")).to_have_text("8 trajectories")
            page.wait_for_selector("#charts .chart svg")
            assert "step 2" in page.locator("#charts .chart").first.text_content()
            train_step(3)
            expect(page.locator("#live-count")).to_have_text("12 trajectories", timeout=15_000)
            expect(page.locator("#charts .chart").first).to_contain_text("step 3", timeout=15_000)
            page.goto(url + "/#/list")
            expect(page.locator("#match-count")).to_have_text("12 matching")
            train_step(4)
            page.wait_for_selector("#new-data", timeout=15_000)
            assert page.locator("#traj-table tbody tr").count() == 12  # the list did not reshuffle by itself
            page.click("#new-data")
            expect(page.locator("#match-count")).to_have_text("16 matching")
    finally:
        writer.close()
