"""A real `terminal` episode in the inspector (#31 item 8): each command, its output and exit code as
the turn's tool result, and the tests' verdict at the end; what the model wrote stays text.

The episodes are recorded by the rollout loop (run_episode with a scripted policy) on a real bubblewrap
workspace, then served by the replay server and opened in Chromium.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
from agentrl.types import Group, Message, ToolCall, Trajectory

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

HOSTILE = "<img src=x onerror=\"window.__pwned = 1\"><script>window.__pwned = 2</script>"
FIRST = f"echo '{HOSTILE}'; echo to-stderr >&2; exit 3"


def record() -> tuple[Trajectory, Trajectory]:
    """Two episodes of the bundled `sum-numbers` task: one solves it, one submits at once."""
    from agentrl.chat.conversation import SimpleChatTokenizer, hermes_content
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.envs.terminal import TerminalEnv
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.episode import run_episode
    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    def call(name: str, **arguments: Any) -> str:
        return hermes_content(Message(role="assistant", content="", tool_calls=[ToolCall(name, arguments, id="c")]))

    async def main() -> tuple[Trajectory, Trajectory]:
        tok = SimpleChatTokenizer()
        async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
            env = TerminalEnv(sandbox=sb)
            solve = (env.harbor_tasks()["sum-numbers"].path / "solution" / "solve.sh").read_text()
            task = {"id": "sum-numbers", "split": "train"}

            def solver(prompt: str) -> str:
                n = prompt.count("<|im_start|>tool\n")
                return call("bash", command=[FIRST, solve][n]) if n < 2 else call("submit")

            def quitter(prompt: str) -> str:
                return call("submit")

            try:
                runs = []
                for policy in (solver, quitter):
                    engine = ScriptedEngine(ScriptedEngine.Config(), tokenizer=tok, reply_fn=policy)
                    runs.append(await run_episode(env, task, engine, tok, RolloutConfig(max_turns=6)))
            finally:
                await env.close()
        return runs[0], runs[1]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trajectory, Trajectory]:
    solved, failed = record()
    assert solved.error is None and solved.reward == 1.0 and len(solved.turns) == 3, solved.error
    assert failed.error is None and failed.reward == 0.0
    solved.id, failed.id = "term-solved", "term-failed"
    solved.group_id = failed.group_id = "term-group"
    run = tmp_path_factory.mktemp("terminal-run")
    with TrajectoryStore(run) as store:
        store.set_run_config({"run": {"name": "terminal"}, "env": {"name": "terminal"},
                              "replay": {"tokenizer": "simple"}})
        store.add_group(Group(task_id=solved.task_id, trajectories=[solved, failed], id="term-group"),
                        step=0, status="eval")
    return run, solved, failed


@pytest.fixture(scope="module")
def server(terminal_run: tuple[Path, Trajectory, Trajectory], serve_store: Any) -> Iterator[str]:
    with serve_store(terminal_run[0] / STORE_FILENAME) as url:
        yield url


def test_commands_outputs_exit_codes_and_the_verdict(server: str, page: Any) -> None:
    page.goto(server + "/#/t/term-solved")
    page.wait_for_selector("#conversation .msg.tool")
    calls = page.locator("#conversation .msg.assistant .toolcall")
    assert calls.count() == 3
    assert [calls.nth(i).locator(".name").text_content() for i in range(3)] == ["bash", "bash", "submit"]
    assert FIRST in calls.nth(0).locator("pre.code").text_content().replace('\\"', '"')  # the command itself
    results = page.locator("#conversation .msg.tool")
    assert results.count() == 2  # the episode ends at `submit`: its tool reply is never sent to the model
    first = results.nth(0).locator("pre.content").text_content()
    assert first == f"{HOSTILE}\nto-stderr\n[exit code 3]"  # output and exit code, as the turn's tool result
    assert results.nth(0).get_attribute("data-turn") == "0"
    assert results.nth(1).locator("pre.content").text_content().endswith("[exit code 0]")
    assert results.nth(1).get_attribute("data-turn") == "1"
    verdict = page.locator("#tests-verdict")
    assert verdict.text_content() == "tests · verdictpassed: reward 1 (exit code 0)"
    last = page.locator("#conversation > .msg").last
    assert last.get_attribute("id") == "tests-verdict"  # at the end, after the last turn's tool result
    assert "pass" in (verdict.get_attribute("class") or "")
    page.click("#play-first")
    assert not verdict.is_visible()  # it belongs to the last turn in playback
    page.click("#play-all")
    assert verdict.is_visible()
    # model text is text: nothing it wrote became an element or ran
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("main img, main script").count() == 0
    assert page.dialogs == [] and not page.console_errors, page.console_errors


def test_a_failed_verdict(server: str, page: Any, terminal_run: tuple[Path, Trajectory, Trajectory]) -> None:
    _, _, failed = terminal_run
    code = int(failed.reward_breakdown["tests_exit_code"])  # Harbor tests may exit 0 and write reward 0
    page.goto(server + "/#/t/term-failed")
    page.wait_for_selector("#tests-verdict")
    verdict = page.locator("#tests-verdict")
    assert verdict.text_content() == f"tests · verdictfailed: reward 0 (exit code {code})"
    assert "fail" in (verdict.get_attribute("class") or "")
    assert page.locator("#reward-breakdown td", has_text="tests_exit_code").count() == 1
    assert not page.console_errors, page.console_errors


def test_no_verdict_without_tests(server: str, page: Any, serve_store: Any, tmp_path: Path,
                                  terminal_run: tuple[Path, Trajectory, Trajectory]) -> None:
    """Envs without task tests (no tests_exit_code in the breakdown) get no verdict card."""
    _, solved, _ = terminal_run
    other = Trajectory.from_dict({**solved.to_dict(), "id": "no-tests", "reward_breakdown": {"correct": 1.0}})
    with TrajectoryStore(tmp_path / "run") as store:
        store.add_trajectory(other, step=0, status="eval")
    with serve_store(tmp_path / "run" / STORE_FILENAME) as url:
        page.goto(url + "/#/t/no-tests")
        page.wait_for_selector("#conversation .msg.tool")
        assert page.locator("#tests-verdict").count() == 0
