"""`midpoint`: a tool any tool-using agentrl env can offer (e.g. `dataset` with `tools: [midpoint]`)."""

from __future__ import annotations

from agentrl import tool


@tool
def midpoint(low: int, high: int) -> int:
    """The integer halfway between low and high (rounded down): the best next guess in a binary search.

    Args:
        low: smallest value still possible
        high: largest value still possible
    """
    if low > high:
        raise ValueError(f"low ({low}) must not exceed high ({high})")
    return (low + high) // 2
