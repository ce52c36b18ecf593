"""Agent frameworks, unmodified but for base URL and key, run multi-turn tool-using agents through the gateway:
the OpenAI Agents SDK and LangGraph (langchain-openai). Their trajectories hold exactly what the engine sampled."""

from __future__ import annotations

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
