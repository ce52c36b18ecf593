"""Several policies through one gateway (`gateway.model_policies`, #33): a request's `model` picks the policy
(LoRA adapter) that samples it, and each recorded turn names it. Agents that name different models (a plain
openai-SDK program, a LangGraph graph of two chat models) yield turns of the two policies, each sampled by its
own adapter; a model outside the mapping is refused in each API's error shape, naming the served models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from policy_engine import PolicyEngine

from agentrl.chat.conversation import Budgets, SimpleChatTokenizer
from agentrl.chat.tool_parsers import HermesParser
from agentrl.gateway import Backend, Gateway, GatewayConfig, TrainerSampling
from agentrl.types import Trajectory

POLICIES = {"proposer-model": "proposer", "checker-model": "checker"}
VERSIONS = {"proposer": 3, "checker": 5}  # each adapter's own version: the turns must carry their sampler's


def _engine(tok: SimpleChatTokenizer) -> PolicyEngine:
    engine = PolicyEngine(tok, {None: lambda p: "base", "proposer": lambda p: "I propose 7.",
                                "checker": lambda p: "Checked: 7 is right." if "7" in p else "Nothing to check."})
    engine.adapter_versions = dict(VERSIONS)
    return engine


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, PolicyEngine, SimpleChatTokenizer]]:
    tok = SimpleChatTokenizer()
    engine = _engine(tok)
    backend = Backend(engine=engine, tokenizer=tok, parser=HermesParser(), sampling=TrainerSampling(1.0),
                      budgets=Budgets(max_turns=8, max_total_tokens=4096, max_new_tokens_per_turn=64))
    async with Gateway(GatewayConfig(model_policies=POLICIES), backend) as gw:
        yield gw, engine, tok


def _turns(trajs: list[Trajectory], tok: SimpleChatTokenizer) -> list[tuple[int, str | None, str, set[int]]]:
    """(call index, policy, sampled text, versions of its tokens) of every turn, in call order."""
    out = []
    for traj in trajs:
        for t in traj.turns:
            ids = traj.token_ids[t.start : t.end]
            assert traj.loss_mask[t.start : t.end] == [1] * len(ids)
            out.append((int(t.info["call"]), t.policy, tok.decode(ids), set(traj.versions[t.start : t.end])))
    return sorted(out, key=lambda x: x[0])


async def test_two_openai_sdk_agents_naming_two_models_give_turns_of_two_policies(
    served: tuple[Gateway, PolicyEngine, SimpleChatTokenizer],
) -> None:
    gw, engine, tok = served
    session = gw.open_session()
    async with openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0) as client:
        task: list[Any] = [{"role": "user", "content": "Pick a number and check it."}]
        proposal = await client.chat.completions.create(
            model="proposer-model", messages=[{"role": "system", "content": "You propose."}, *task])
        said = proposal.choices[0].message.content
        assert said == "I propose 7." and proposal.model == "proposer-model"
        check = await client.chat.completions.create(
            model="checker-model", messages=[{"role": "system", "content": "You check."}, *task,
                                             {"role": "user", "content": f"The proposer said: {said}"}])
        assert check.choices[0].message.content == "Checked: 7 is right." and check.model == "checker-model"
        # the proposer's own conversation goes on: its branch extends, sampled by its adapter again
        again = await client.chat.completions.create(
            model="proposer-model", messages=[{"role": "system", "content": "You propose."}, *task,
                                              {"role": "assistant", "content": said},
                                              {"role": "user", "content": "Once more."}])
        assert again.choices[0].message.content == "I propose 7."
        models = await client.models.list()
        assert [m.id for m in models.data] == list(POLICIES)
    gw.close_session(session)
    assert engine.asked == ["proposer", "checker", "proposer"]
    trajs = session.trajectories(task={}, env="agent")
    assert len(trajs) == 2  # two agents, two conversations (branches)
    turns = _turns(trajs, tok)
    assert [(c, p) for c, p, _, _ in turns] == [(0, "proposer"), (1, "checker"), (2, "proposer")]
    assert all(v == {VERSIONS[p]} for _, p, _, v in turns if p is not None)  # each token's version: its adapter's
    assert turns[1][2].startswith("Checked: 7 is right.")
    by_branch = {traj.info["gateway"]["branch"]: {t.policy for t in traj.turns} for traj in trajs}
    assert sorted(by_branch.values(), key=sorted) == [{"checker"}, {"proposer"}]
    restored = Trajectory.from_dict(trajs[0].to_dict())  # the policy survives the store's round trip
    assert [t.policy for t in restored.turns] == [t.policy for t in trajs[0].turns]


async def test_langgraph_graph_of_two_models_samples_each_node_with_its_policy(
    served: tuple[Gateway, PolicyEngine, SimpleChatTokenizer],
) -> None:
    from langchain_core.messages import SystemMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph

    gw, engine, tok = served
    session = gw.open_session()

    def llm(model: str) -> ChatOpenAI:
        return ChatOpenAI(model=model, base_url=gw.base_url(session), api_key=session.key, max_retries=0)  # type: ignore[arg-type]

    proposer, checker = llm("proposer-model"), llm("checker-model")

    async def propose(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await proposer.ainvoke([SystemMessage("You propose."), *state["messages"]])]}

    async def check(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await checker.ainvoke([SystemMessage("You check."), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("propose", propose)
    graph.add_node("check", check)
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "check")
    start: Any = {"messages": [("user", "Pick a number and check it.")]}
    out = await graph.compile().ainvoke(start)
    assert [m.content for m in out["messages"][1:]] == ["I propose 7.", "Checked: 7 is right."]
    gw.close_session(session)
    assert engine.asked == ["proposer", "checker"]
    turns = _turns(session.trajectories(task={}, env="agent"), tok)
    assert [(p, v) for _, p, _, v in turns] == [("proposer", {3}), ("checker", {5})]


async def test_a_model_outside_the_mapping_is_refused_in_each_apis_shape(
    served: tuple[Gateway, PolicyEngine, SimpleChatTokenizer],
) -> None:
    gw, engine, _ = served
    session = gw.open_session()
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    async with openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0) as client:
        for call in (lambda: client.chat.completions.create(model="gpt-4o", messages=messages),
                     lambda: client.responses.create(model="gpt-4o", input="hi"),
                     lambda: client.completions.create(model="gpt-4o", prompt="hi")):
            with pytest.raises(openai.NotFoundError) as info:
                await call()
            body = info.value.body
            assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
            assert "'proposer-model'" in body["message"] and "'checker-model'" in body["message"]
    async with anthropic.AsyncAnthropic(base_url=f"{gw.url}/s/{session.id}", api_key=session.key,
                                        max_retries=0) as claude:
        with pytest.raises(anthropic.NotFoundError) as refused:
            await claude.messages.create(model="claude-x", max_tokens=8, messages=messages)
        error = refused.value.body
        assert isinstance(error, dict) and error["type"] == "error" and error["error"]["type"] == "not_found_error"
        assert "'checker-model'" in error["error"]["message"]
        reply = await claude.messages.create(model="checker-model", max_tokens=32, messages=messages)
        assert reply.model == "checker-model" and reply.content[0].type == "text"
    assert engine.asked == ["checker"]  # no refused call reached the engine
    async with httpx.AsyncClient(base_url=gw.url) as http:  # the token-id route samples with the policy too
        r = await http.post(f"/s/{session.id}/v1/completions", json={"model": "proposer-model", "prompt": [1, 2, 3]},
                            headers={"Authorization": f"Bearer {session.key}"})
        assert r.status_code == 200 and r.json()["model"] == "proposer-model"
    assert engine.asked == ["checker", "proposer"]
    tokens = [t for t in session.trajectories(task={}, env="agent") if t.info["gateway"]["kind"] == "tokens"]
    assert [t.policy for t in tokens[0].turns] == ["proposer"]


async def test_without_a_mapping_the_model_field_is_ignored() -> None:
    tok = SimpleChatTokenizer()
    engine = _engine(tok)
    backend = Backend(engine=engine, tokenizer=tok, parser=HermesParser(), sampling=TrainerSampling(1.0))
    async with Gateway(GatewayConfig(), backend) as gw:
        session = gw.open_session()
        async with openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0) as client:
            r = await client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "base" and r.model == "agentrl"
    assert engine.asked == [None]
    assert [t.policy for t in session.trajectories(task={}, env="agent")[0].turns] == [None]


def test_config_refuses_empty_names() -> None:
    with pytest.raises(ValueError, match="model_policies"):
        GatewayConfig(model_policies={"m": ""})


async def test_a_default_policy_samples_models_outside_the_mapping() -> None:
    tok = SimpleChatTokenizer()
    engine = _engine(tok)
    backend = Backend(engine=engine, tokenizer=tok, parser=HermesParser(), sampling=TrainerSampling(1.0))
    async with Gateway(GatewayConfig(model_policies={"checker-model": "checker"}, default_policy="proposer"),
                       backend) as gw:  # fmt: skip
        session = gw.open_session()
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0) as client:
            first = await client.chat.completions.create(model="gpt-4o", messages=messages)
            second = await client.chat.completions.create(model="checker-model", messages=messages)
        assert first.choices[0].message.content == "I propose 7."
        assert second.choices[0].message.content == "Nothing to check."
    assert engine.asked == ["proposer", "checker"]
