"""agentrl: asynchronous agentic RL for language models.

The names exported here are what an env, tool or reward author needs::

    import agentrl

    @agentrl.env("guess")
    class Guess(agentrl.Env): ...

    @agentrl.tool
    def add(a: int, b: int) -> int: ...

Importing agentrl never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.errors import AgentrlError, ConfigError, PluginError
from agentrl.registry import Plugins, env, plugin, reward
from agentrl.types import Group, Message, ToolCall, Trajectory

if TYPE_CHECKING:
    from agentrl.tools import Tool, tool

__all__ = [
    "AgentrlError",
    "ConfigError",
    "Env",
    "EnvConfig",
    "Group",
    "Message",
    "PluginError",
    "Plugins",
    "StepResult",
    "Task",
    "Tool",
    "ToolCall",
    "Trajectory",
    "env",
    "plugin",
    "reward",
    "tool",
]


def __getattr__(name: str) -> Any:
    # `tool`/`Tool` live in agentrl.tools, imported on first use.
    if name in ("tool", "Tool"):
        from agentrl import tools

        return getattr(tools, name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
