"""Agent frameworks, unmodified but for base URL and key, run multi-turn tool-using agents through the gateway:
the OpenAI Agents SDK, LangGraph (langchain-openai), pydantic-ai and smolagents'
CodeAgent. Their trajectories hold exactly what the engine sampled."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from gateway_helpers import SYSTEM, RecordingEngine, assert_token_exact, calc, make_backend

from agentrl.gateway import Gateway, GatewayConfig

pytestmark = pytest.mark.model


@pytest.fixture
async def recorded(scripted: Any, chat_tokenizer: Any) -> AsyncIterator[tuple[Gateway, RecordingEngine]]:
    engine = RecordingEngine(scripted)
    async with Gateway(GatewayConfig(), make_backend(engine, chat_tokenizer)) as gw:
        yield gw, engine


def _check(gw: Gateway, session: Any, engine: RecordingEngine, calls: int) -> None:
    trajs = session.trajectories(task={"id": "t"}, env="agent")
    assert len(trajs) == 1, [t.info for t in trajs]  # the framework's resent history matched: no branch
    assert len(engine.sampled) == calls
    assert_token_exact(trajs[0], engine.sampled)
    roles = [m.role for m in trajs[0].messages]
    assert roles[-3:] == ["assistant", "tool", "assistant"] and trajs[0].messages[-3].tool_calls


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_sdk(recorded: tuple[Gateway, RecordingEngine], stream: bool) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    gw, engine = recorded

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(calc(expression))

    for question, answer in [("What is 12 + 30?", 42), ("What is 6 * 7 + 1?", 43)]:
        engine.sampled.clear()
        session = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
        agent = Agent(name="calc", instructions=SYSTEM, tools=[calculator],
                      model=OpenAIChatCompletionsModel(model="agentrl", openai_client=client))
        if stream:
            result: Any = Runner.run_streamed(agent, question)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question)
        await client.close()
        assert result.final_output == f"Answer: {answer}"
        _check(gw, session, engine, calls=2)


async def test_langgraph_react_agent(recorded: tuple[Gateway, RecordingEngine]) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    gw, engine = recorded

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(calc(expression))

    for question, answer in [("What is 20 + 22?", 42), ("What is 3 * 3?", 9)]:
        engine.sampled.clear()
        session = gw.open_session()
        llm = ChatOpenAI(model="agentrl", base_url=gw.base_url(session), api_key=session.key, max_retries=0)  # type: ignore[arg-type]
        agent = create_react_agent(llm, [calculator], prompt=SYSTEM)
        out = await agent.ainvoke({"messages": [("user", question)]})
        assert out["messages"][-1].content == f"Answer: {answer}"
        _check(gw, session, engine, calls=2)


async def test_pydantic_ai_agent(recorded: tuple[Gateway, RecordingEngine]) -> None:
    """pydantic-ai's `Agent` on its OpenAI chat model, its defaults: a tool call, then the answer."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(calc(expression))

    gw, engine = recorded
    for question, answer in [("What is 5 + 8?", 13), ("What is 4 * 4?", 16)]:
        engine.sampled.clear()
        session = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.key, max_retries=0)
        model = OpenAIChatModel("agentrl", provider=OpenAIProvider(openai_client=client))
        agent = Agent(model, instructions=SYSTEM, tools=[calculator])
        out = await agent.run(question)
        await client.close()
        assert out.output == f"Answer: {answer}"
        _check(gw, session, engine, calls=2)


async def test_smolagents_code_agent(chat_tokenizer: Any) -> None:
    """smolagents' `CodeAgent` with its defaults (its code-block format, its stop sequences, its local executor):
    the scripted model writes the code that calls `final_answer`; the run ends with that answer, token-exact."""
    import asyncio

    smolagents = pytest.importorskip("smolagents")
    from agentrl.engines.scripted import ScriptedEngine

    def reply(prompt: str) -> str:
        expression = re.findall(r"What is ([0-9+*\- ]+)\?", prompt)[-1].strip()
        return f"Thought: I compute it.\n<code>\nfinal_answer({expression})\n</code>"

    engine = RecordingEngine(ScriptedEngine(ScriptedEngine.Config(logprob=-0.5), tokenizer=chat_tokenizer,
                                            reply_fn=reply))
    async with Gateway(GatewayConfig(), make_backend(engine, chat_tokenizer)) as gw:
        session = gw.open_session()

        def run() -> Any:
            model = smolagents.OpenAIServerModel(model_id="agentrl", api_base=gw.base_url(session), api_key=session.key)
            return smolagents.CodeAgent(tools=[], model=model, max_steps=2, verbosity_level=0).run("What is 6 * 7?")

        assert await asyncio.to_thread(run) == 42
        trajs = session.trajectories(task={}, env="agent")
        assert len(trajs) == 1 and len(engine.sampled) == 1
        assert_token_exact(trajs[0], engine.sampled)
