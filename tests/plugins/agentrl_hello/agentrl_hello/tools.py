"""The `greet` tool."""

from __future__ import annotations

import agentrl


@agentrl.tool
def greet(name: str) -> str:
    """Return a friendly greeting for `name`.

    Args:
        name: who to greet.
    """
    return f"Hello, {name}!"
