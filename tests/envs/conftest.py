"""Fixtures for env tests: a real local (bubblewrap) sandbox shared per test."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest


@pytest.fixture
async def local_sandbox() -> AsyncIterator[Any]:
    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    async with LocalSandbox(LocalConfig(pool_size=2)) as sandbox:
        yield sandbox


def _shortest_lake_path(board: list[str]) -> list[str]:
    """BFS over the rendered board (P = start) avoiding holes; the solution a model should find."""
    moves = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    start = next((r, c) for r, row in enumerate(board) for c, ch in enumerate(row) if ch == "P")
    queue: deque[tuple[tuple[int, int], list[str]]] = deque([(start, [])])
    seen = {start}
    while queue:
        (r, c), path = queue.popleft()
        if board[r][c] == "G":
            return path
        for name, (dr, dc) in moves.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < len(board) and 0 <= nc < len(board[0]) and board[nr][nc] != "H" and (nr, nc) not in seen:
                seen.add((nr, nc))
                queue.append(((nr, nc), [*path, name]))
    raise AssertionError("generated map has no path")


@pytest.fixture
def shortest_lake_path() -> Callable[[list[str]], list[str]]:
    """BFS solver for a rendered FrozenLake board: the moves a perfect policy makes."""
    return _shortest_lake_path
