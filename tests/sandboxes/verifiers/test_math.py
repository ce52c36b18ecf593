"""The math reward: extraction, equivalence, and a hard timeout in a worker process."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentrl.envkit.rewards import Reward
from agentrl.sandboxes.verifiers.math import MathConfig, MathVerifier, extract_answer, last_boxed
from agentrl.sandboxes.verifiers.workers import ProcessPool, WorkerError
from agentrl.types import Message


def _msgs(text: str) -> list[Message]:
    return [Message(role="user", content="q? 99"), Message(role="assistant", content=text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}} done", (r"\frac{1}{2}", "boxed")),
        (r"\boxed{1} then \boxed{\sqrt{x^{2}}}", (r"\sqrt{x^{2}}", "boxed")),
        ("The answer is: 42.", ("42", "answer_line")),
        ("Answer: $x+1$\nmore text", ("x+1", "answer_line")),
        ("first 3 then 1,234.5 apples", ("1,234.5", "last_number")),
        ("no digits here", (None, "none")),
    ],
)
def test_extraction(text: str, expected: tuple[str | None, str]) -> None:
    assert extract_answer(text) == expected


def test_unbalanced_boxed() -> None:
    assert last_boxed(r"\boxed{1 + {2}") is None


@pytest.mark.slow
async def test_scores_equivalent_answers() -> None:
    v = MathVerifier(MathConfig(timeout_s=60))
    assert isinstance(v, Reward)
    try:
        cases = [
            (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
            ("Answer: 1,000", "1000", 1.0),
            (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
            (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
            (r"\boxed{3}", "4", 0.0),
            (r"\boxed{x+2}", "x+1", 0.0),
            ("I think 7", "7", 1.0),
            ("nothing", "7", 0.0),
        ]
        for text, gold, want in cases:
            r = await v.score({"answer": gold}, _msgs(text))
            assert r.value == want, (text, gold, r)
        r = await v.score({"answer": 7}, _msgs("I think 7"))
        assert r.breakdown == {"correct": 1.0, "formatted": 0.0}
        with pytest.raises(KeyError, match="answer"):
            await v.score({"solution": "1"}, _msgs("1"))
    finally:
        await v.close()


def _slow_identity(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x


def _fail() -> None:
    raise ValueError("bad input")


async def test_worker_pool_hard_timeout_kills_and_recovers() -> None:
    pool = ProcessPool(1)
    try:
        assert await pool.call(_slow_identity, 5, 0.0, timeout=60) == 5
        with pytest.raises(TimeoutError):
            await pool.call(_slow_identity, 1, 60.0, timeout=0.5)
        assert pool.restarts == 1
        assert await pool.call(_slow_identity, 6, 0.0, timeout=60) == 6
        with pytest.raises(WorkerError, match="ValueError: bad input"):
            await pool.call(_fail, timeout=60)
    finally:
        await pool.close()


async def test_works_from_worker_threads() -> None:
    """math-verify's SIGALRM breaks in threads; our checks run in a process, so threads are fine."""
    v = MathVerifier(MathConfig(timeout_s=60))
    results: list[float] = []

    async def score_and_close() -> float:
        try:
            return (await v.score({"answer": "(x+1)^2"}, _msgs(r"\boxed{x^2+2x+1}"))).value
        finally:
            await v.close()

    def in_thread() -> None:
        results.append(asyncio.run(score_and_close()))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(120)
    assert results == [1.0]
