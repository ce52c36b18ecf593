"""`agentrl.run.loop.train`'s restart policy: which failures restart the run, how often, from where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentrl.config import RunConfig
from agentrl.errors import AgentrlError
from agentrl.run import loop
from agentrl.run.run_dir import RunDir


class Lost(AgentrlError):
    restartable = True


def config(max_restarts: int) -> RunConfig:
    return RunConfig.model_validate({"env": "calculator", "run": {"max_restarts": max_restarts}})


def fake_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcomes: list[BaseException | None]) -> list[Any]:
    """Replace one start of the run: each call takes the next outcome (raise it, or finish)."""
    seen: list[Any] = []

    async def once(cfg: RunConfig, attempt: Any) -> Path:
        seen.append((attempt.run.path if attempt.run else None, attempt.restarts))
        if attempt.run is None:
            attempt.run = RunDir.create(tmp_path, "r")
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return attempt.run.path

    monkeypatch.setattr(loop, "_train_once", once)
    return seen


async def test_restartable_failures_restart_from_the_same_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = fake_starts(monkeypatch, tmp_path, [Lost("rank 1 died"), Lost("rank 0 died"), None])
    path = await loop.train(config(2))
    assert [restarts for _, restarts in seen] == [0, 1, 2]
    assert seen[0][0] is None and seen[1][0] == seen[2][0] == path  # the restarts resume the run it made


async def test_restarts_stop_at_the_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_starts(monkeypatch, tmp_path, [Lost("first"), Lost("second")])
    with pytest.raises(Lost, match="second"):
        await loop.train(config(1))
    fake_starts(monkeypatch, tmp_path, [Lost("only")])
    with pytest.raises(Lost, match="only"):
        await loop.train(config(0))  # the default: no restarts


async def test_other_failures_are_not_restarted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = fake_starts(monkeypatch, tmp_path, [AgentrlError("alert stopped the run"), None])
    with pytest.raises(AgentrlError, match="alert stopped"):
        await loop.train(config(3))
    assert len(seen) == 1


async def test_a_failure_before_the_run_exists_is_not_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    async def once(cfg: RunConfig, attempt: Any) -> Path:
        calls.append(attempt.restarts)
        raise Lost("the group never started")

    monkeypatch.setattr(loop, "_train_once", once)
    with pytest.raises(Lost):
        await loop.train(config(3))
    assert calls == [0]
