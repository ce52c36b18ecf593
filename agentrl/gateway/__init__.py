"""An OpenAI-compatible gateway over any agentrl engine: unmodified agent code, token-exact trajectories.

See docs/gateway.md. `Gateway` serves sessions over HTTP; a `Session` turns
one episode's calls into trajectories (one per branch); `Backend` holds what
the sessions share (engine, chat template, tool parser, the trainer's sampling).
"""

from agentrl.gateway.config import GatewayConfig
from agentrl.gateway.protocol import GatewayError, TrainerSampling
from agentrl.gateway.server import Gateway
from agentrl.gateway.session import Backend, Session

__all__ = ["Backend", "Gateway", "GatewayConfig", "GatewayError", "Session", "TrainerSampling"]
