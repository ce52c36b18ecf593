"""Constrained decoding with exact behaviour logprobs on the `hf` engine (a tiny random Llama, SmolLM2's
tokenizer): a forced call (`tool_choice: required` / named, in each API) always parses; `response_format`
json_schema always gives schema-valid JSON; the recorded logprob of each sampled token is that of the masked
distribution (checked against a reference: a full forward pass, the grammar's mask, log_softmax), and the
turn records that it was constrained."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from gateway_helpers import make_backend

from agentrl.chat.conversation import Budgets, HFChatTokenizer
from agentrl.engines.constrained import Grammars, json_grammar, tool_call_grammar
from agentrl.gateway import Gateway, GatewayConfig

pytestmark = [pytest.mark.model, pytest.mark.slow]
TOOLS = [{"type": "function", "function": {"name": "pick", "description": "Pick an operation.", "parameters": {
    "type": "object", "properties": {"op": {"enum": ["add", "mul"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
    "required": ["op", "n"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "stop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Pick an operation."}]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: str) -> Any:
    from agentrl.engines.hf import HFEngine

    return HFEngine(HFEngine.Config(model=tiny_llama_path, dtype="fp32", max_batch_size=8, seed=3))


@pytest.fixture
async def hf_gateway(tiny: Any, tiny_llama_path: str) -> AsyncIterator[Gateway]:
    tokenizer = HFChatTokenizer.from_pretrained(tiny_llama_path)
    budgets = Budgets(max_turns=8, max_total_tokens=2048, max_new_tokens_per_turn=64)
    async with Gateway(GatewayConfig(), make_backend(tiny, tokenizer, budgets=budgets)) as gw:
        yield gw


def _reference_logprobs(engine: Any, grammars: Grammars, grammar: str, prompt: list[int], ids: list[int],
                        stop_ids: list[int]) -> tuple[list[float], list[float]]:
    """(masked, unmasked) logprobs of `ids` after `prompt`: one forward pass, the grammar stepped token by token."""
    import torch

    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    matcher = grammars.matcher(grammar, stop_ids)
    masked, plain = [], []
    for row, tok in zip(logits, ids, strict=True):
        allowed = torch.from_numpy(matcher.allowed())
        masked.append(float(row.masked_fill(~allowed, float("-inf")).log_softmax(-1)[tok]))
        plain.append(float(row.log_softmax(-1)[tok]))
        matcher.consume(tok)
    return masked, plain


async def test_forced_calls_parse_and_logprobs_are_the_masked_distributions(hf_gateway: Gateway, tiny: Any) -> None:
    session = hf_gateway.open_session()
    url = hf_gateway.base_url(session)
    chosen = []
    async with httpx.AsyncClient(timeout=120) as http:
        for seed in range(4):
            choice: Any = "required" if seed % 2 else {"type": "function", "function": {"name": "pick"}}
            r = await http.post(f"{url}/chat/completions", json={
                "model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "seed": seed,
                "logprobs": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "tool_calls", body["choices"][0]["message"]
            [call] = body["choices"][0]["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            name = call["function"]["name"]
            chosen.append(name)
            if seed % 2 == 0 or name == "pick":
                assert name == "pick" and args["op"] in ("add", "mul") and 0 <= args["n"] <= 9
            else:
                assert name == "stop" and args == {}
            # the recorded logprobs are those of the masked distribution (a reference computation)
            backend = hf_gateway.backend
            grammar = tool_call_grammar(TOOLS, "hermes", None if seed % 2 else "pick")
            ids = body["choices"][0]["token_ids"]
            recorded = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
            masked, plain = _reference_logprobs(tiny, tiny._grammars, grammar, body["prompt_token_ids"], ids,
                                                list(backend.tokenizer.eos_ids))
            assert recorded == pytest.approx(masked, abs=2e-4)
            assert any(abs(m - p) > 1e-3 for m, p in zip(masked, plain, strict=True))  # the mask did change them
    trajs = session.trajectories(task={}, env="agent")
    turns = [t for traj in trajs for t in traj.turns]
    assert len(turns) == 4 and all(t.info["constrained"].startswith("tool_choice=") for t in turns)
    assert sum(traj.metrics["constrained_turns"] for traj in trajs) == 4


async def test_forced_calls_in_messages_and_responses_and_json_schema(hf_gateway: Gateway) -> None:
    session = hf_gateway.open_session()
    url = hf_gateway.base_url(session)
    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    responses_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"], "additionalProperties": False}
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {session.key}"}) as http:
        m = (await http.post(f"{hf_gateway.url}/s/{session.id}/v1/messages", json={
            "model": "m", "max_tokens": 64, "messages": MESSAGES, "tools": anthropic_tools,
            "tool_choice": {"type": "tool", "name": "pick"}})).json()
        assert m["stop_reason"] == "tool_use" and m["content"][-1]["name"] == "pick", m
        r = (await http.post(f"{url}/responses", json={
            "model": "m", "input": "Pick.", "tools": responses_tools, "tool_choice": "required"})).json()
        assert r["output"][-1]["type"] == "function_call", r
        j = (await http.post(f"{url}/chat/completions", json={
            "model": "m", "messages": MESSAGES, "response_format": {
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})).json()
        content = j["choices"][0]["message"]["content"]
        assert 0 <= json.loads(content)["answer"] <= 99, content
    labels = sorted(t.info["constrained"] for traj in session.trajectories(task={}, env="agent") for t in traj.turns)
    assert labels == ["response_format=json_schema", "tool_choice='required'", "tool_choice={type: tool, name: 'pick'}"]


def test_grammar_builders_refuse_what_they_cannot_force(chat_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="forced tool calls are served for the hermes, json, llama3_json"):
        tool_call_grammar(TOOLS, "pythonic")
    with pytest.raises(ValueError, match="'nope', which is not one of the request's tools"):
        tool_call_grammar(TOOLS, "hermes", "nope")
    grammars = Grammars(chat_tokenizer, [2], 49152)
    text = '{"answer": 7}'
    matcher = grammars.matcher(json_grammar({"type": "object"}), [2])
    for tok in chat_tokenizer.encode(text):
        assert matcher.allowed()[tok]
        matcher.consume(tok)
    assert matcher.allowed()[2]  # complete: the end may come
    bad = grammars.matcher(json_grammar({"type": "object"}), [2])
    assert not bad.allowed()[chat_tokenizer.encode("hello")[0]]


async def test_smolagents_tool_calling_agent_with_its_defaults(hf_gateway: Gateway) -> None:
    """smolagents' `ToolCallingAgent` sends `tool_choice: "required"` on every step: served (it was a 400), each
    step's reply is a call of one of its tools in the parser's format (a random model's free-text argument may run
    into the token budget; the call is then cut there, still inside the grammar), and the turns record it."""
    import asyncio

    smolagents = pytest.importorskip("smolagents")

    @smolagents.tool
    def pick(op: str) -> str:
        """Pick an operation.

        Args:
            op: the operation
        """
        return op

    session = hf_gateway.open_session()

    def run() -> Any:
        model = smolagents.OpenAIServerModel(model_id="m", api_base=hf_gateway.base_url(session), api_key=session.key)
        agent = smolagents.ToolCallingAgent(tools=[pick], model=model, max_steps=2, verbosity_level=0)
        return agent.run("Pick an operation.")

    await asyncio.to_thread(run)
    tokenizer = hf_gateway.backend.tokenizer
    turns = {t.info["call"]: (traj, t) for traj in session.trajectories(task={}, env="agent") for t in traj.turns}
    forced = [(traj, t) for traj, t in turns.values() if t.info.get("constrained") == "tool_choice='required'"]
    assert len(forced) == 2  # both steps (max_steps=2) forced a call
    for traj, turn in forced:
        text = tokenizer.decode(traj.token_ids[turn.start : turn.end])
        head = '<tool_call>\n{"name": "'
        assert text.startswith(head) and text[len(head):].split('"')[0] in ("pick", "final_answer"), text
        if turn.info["finish_reason"] == "stop":  # complete: the call parses
            assert hf_gateway.backend.parser.parse(text.removesuffix("<|im_end|>")).tool_calls[0].error is None


async def test_training_on_constrained_turns_corrects_for_the_mask(hf_gateway: Gateway, tiny: Any,
                                                                    tiny_llama_path: str) -> None:  # fmt: skip
    """A GRPO step on forced-call turns: the trainer's fresh-token mismatch is exactly the grammar's mask (its own
    logprobs are the unmasked distribution's, the behaviour's the masked one's), and the IS metrics are logged."""
    import dataclasses
    import math

    from agentrl.trainers.torch_trainer import TorchTrainer
    from agentrl.types import Group

    session = hf_gateway.open_session()
    url = hf_gateway.base_url(session)
    shifts = []
    async with httpx.AsyncClient(timeout=120) as http:
        for seed in range(4):
            r = await http.post(f"{url}/chat/completions", json={
                "model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "seed": seed,
                "return_token_ids": True})  # fmt: skip
            assert r.status_code == 200, r.text
            body = r.json()
            masked, plain = _reference_logprobs(tiny, tiny._grammars, tool_call_grammar(TOOLS, "hermes", None),
                                                body["prompt_token_ids"], body["choices"][0]["token_ids"],
                                                list(hf_gateway.backend.tokenizer.eos_ids))  # fmt: skip
            shifts += [abs(m - p) for m, p in zip(masked, plain, strict=True)]
    trajs = session.trajectories(task={}, env="agent")
    assert len(trajs) == 4 and all(t.turns[0].info["constrained"] == "tool_choice='required'" for t in trajs)
    group = Group(task_id="t", id="g0", trajectories=[
        dataclasses.replace(t, reward=float(k % 2), group_id="g0") for k, t in enumerate(trajs)])  # fmt: skip
    trainer = TorchTrainer({"dtype": "fp32", "off_policy": {"mode": "tis", "tis_cap": 2.0}}, tiny_llama_path)
    metrics = trainer.train_step([group]).metrics
    assert metrics["off_policy/fresh_fraction"] == pytest.approx(1.0)  # the engine served the trainer's version
    assert metrics["off_policy/fresh_max_abs_dlogp"] == pytest.approx(max(shifts), abs=1e-3) and max(shifts) > 1e-3
    assert metrics["off_policy/mismatch_kl"] > 0 and 0 < metrics["off_policy/ess"] <= 1
    assert math.isfinite(metrics["loss"])
