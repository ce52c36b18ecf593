"""Gateway trajectories, with their branches, in the replay UI (API and browser).

One agent episode through the OpenAI-compatible gateway (the real `openai` SDK, a
scripted calculator model on SmolLM2's tokenizer) rewrites its history between
calls, so the episode leaves two trajectories in one group: the first branch and
the rewritten one, whose `info.branch` names its parent. They are stored as a
training run stores a group, and the replay server and app must show both, the
link between them and the token view of each.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from gateway_helpers import TOOLS, calc, calculator_reply, make_backend

sys.path.remove(str(Path(__file__).parents[1] / "gateway"))

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.gateway import Gateway, GatewayConfig
from agentrl.replay.server import ReplaySettings, create_app
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore
from agentrl.types import Group, Trajectory

pytestmark = pytest.mark.model


async def rewriting_episode(smollm2_path: str) -> list[Trajectory]:
    """An openai-SDK agent that calls the calculator, then answers from a summary instead of its history."""
    import openai

    tokenizer = HFChatTokenizer.from_pretrained(smollm2_path)
    engine = ScriptedEngine(ScriptedEngine.Config(logprob=-0.5), tokenizer=tokenizer, reply_fn=calculator_reply)
    async with Gateway(GatewayConfig(), make_backend(engine, tokenizer)) as gateway:
        session = gateway.open_session()
        async with openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0) as client:
            question = "What is 12 + 30?"
            first = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": question}], tools=TOOLS)  # type: ignore[list-item]
            call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
            value = calc(json.loads(call.function.arguments)["expression"])  # type: ignore[union-attr]
            summary = [{"role": "user", "content": f"{question} (the calculator said {value})"},
                       {"role": "assistant", "content": "Let me check."},
                       {"role": "tool", "tool_call_id": "x", "content": str(value)}]
            await client.chat.completions.create(model="m", messages=summary, tools=TOOLS)  # type: ignore[arg-type]
        gateway.close_session(session)
    return session.trajectories(task={"id": "q0", "question": question}, env="agent", group_id="gw-group", reward=1.0)


@pytest.fixture(scope="module")
def gateway_run(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> Iterator[tuple[Path, list[Trajectory]]]:
    run = tmp_path_factory.mktemp("gateway-run")
    trajs = asyncio.run(rewriting_episode(smollm2_path))
    with TrajectoryStore(run) as store:
        store.set_run_config({"run": {"name": "gateway-replay"}, "model": {"path": smollm2_path},
                              "env": {"name": "agent", "agent": "agent.py:solve", "tasks": []}})
        store.add_group(Group(task_id="q0", trajectories=trajs, id="gw-group"), step=1, status="trained")
    yield run, trajs


@pytest.fixture
async def client(gateway_run: tuple[Path, list[Trajectory]]) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(ReplaySettings(gateway_run[0] / STORE_FILENAME))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def get_json(client: TestClient[Any, Any], path: str) -> Any:
    for _ in range(600):  # the run's tokenizer loads in the background (503 until then)
        resp = await client.get(path)
        if resp.status != 503:
            break
        await asyncio.sleep(0.1)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_the_api_lists_both_branches_and_links_them(
    client: TestClient[Any, Any], gateway_run: tuple[Path, list[Trajectory]]
) -> None:
    main, first = gateway_run[1]
    assert main.info["gateway"]["main"] and main.info["branch"]["parent"] == first.id  # type: ignore[index,call-overload]
    listed = await get_json(client, "/api/trajectories?env=agent")
    assert {r["id"] for r in listed["items"]} == {main.id, first.id}
    group = await get_json(client, "/api/groups/gw-group")
    assert {m["id"] for m in group["members"]} == {main.id, first.id}
    shown = await get_json(client, f"/api/trajectories/{main.id}")
    traj, tokens = shown["trajectory"], shown["tokens"]
    assert shown["status"] == "trained"
    assert traj["info"]["branch"] == {"parent": first.id, "reason": "message 0 (user) rewritten"}
    assert traj["info"]["gateway"]["branches"] == 2
    assert [m["role"] for m in traj["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert tokens["ids"] == main.token_ids and tokens["loss_mask"] == main.loss_mask
    assert tokens["tokenizer"] != "none" and "".join(tokens["text"]).endswith("Let me check.<|im_end|>\n"
                                                                             "<|im_start|>tool\n42<|im_end|>\n"
                                                                             "<|im_start|>assistant\nAnswer: 42<|im_end|>")
    parent = (await get_json(client, f"/api/trajectories/{first.id}"))["trajectory"]
    assert "branch" not in parent["info"] and parent["info"]["gateway"]["main"] is False
    text = "".join((await get_json(client, f"/api/trajectories/{first.id}"))["tokens"]["text"])
    assert text.endswith('"arguments": {"expression": "12 + 30"}}\n</tool_call><|im_end|>')  # the call it sampled


@pytest.mark.browser
def test_the_app_shows_a_branch_its_parent_and_the_group(
    gateway_run: tuple[Path, list[Trajectory]], serve_store: Any, page: Any
) -> None:
    expect: Any = pytest.importorskip("playwright.sync_api").expect
    run, (main, first) = gateway_run
    with serve_store(run / STORE_FILENAME) as url:
        page.goto(url + f"/#/t/{main.id}")
        page.wait_for_selector("#conversation .msg.assistant:not(.prompt)")
        assert main.id in page.locator("h2").first.text_content()
        assert page.locator("#conversation .msg.assistant:not(.prompt) pre.content").last.text_content() == "Answer: 42"
        assert page.locator("#branch-of").text_content() == f"branch of{first.id} (message 0 (user) rewritten)"
        assert "history this branch was given (3 messages" in page.locator("#demonstrations summary").text_content()
        info = page.locator("details.panel", has_text="trajectory info")
        info.locator("summary").click()
        expect(info.locator("pre")).to_contain_text(f'"parent": "{first.id}"')
        expect(info.locator("pre")).to_contain_text("message 0 (user) rewritten")

        page.goto(url + f"/#/t/{main.id}?tab=group")
        page.wait_for_selector("#siblings .sibling")
        cards = page.locator("#siblings .sibling")
        assert cards.count() == 2
        assert {cards.nth(i).get_attribute("data-id") for i in range(2)} == {main.id, first.id}

        page.goto(url + f"/#/t/{main.id}")
        page.wait_for_selector("#branch-parent")
        page.click("#branch-parent")  # to the branch it came from
        page.wait_for_selector(f"h2:has-text('{first.id}')")
        page.wait_for_selector("#conversation .msg.assistant:not(.prompt) .toolcall .name")
        assert page.locator("#branch-of").count() == 0
        assert page.locator("#conversation .msg:not(.prompt) .toolcall .name").first.text_content() == "calculator"
        assert not page.console_errors, page.console_errors
