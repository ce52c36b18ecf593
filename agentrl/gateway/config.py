"""The gateway's own config (the `gateway:` settings of the agent env and of `agentrl gateway`)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.gateway.protocol import GatewayError

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GatewayConfig(BaseModel):
    """Where the gateway listens, who may call it and how replies are parsed."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="address to bind; anything but loopback requires `token`")
    port: int = Field(default=0, ge=0, le=65535, description="port to bind; 0 = any free port")
    token: str | None = Field(default=None, min_length=16,
        description="admin bearer token: opens/closes sessions, and any call must carry it or a session key",
    )
    model_name: str = Field(default="agentrl", min_length=1, description="the model id /v1/models lists and replies name")
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024, description="largest request body accepted (413 above)")
    tool_parser: str = Field(default="hermes", description="how replies become tool calls: hermes, llama3_json, json or a plugin")
    tools_in_prompt: bool = Field(default=True, description="render the request's `tools` into the prompt; false when the agent's own system prompt "
        "already shows the call format (calls are parsed either way)",
    )
    max_sessions: int = Field(default=4096, ge=1, description="open sessions at once; opening more is a 429")
    model_policies: dict[str, str] = Field(default_factory=dict,
        description="a request's `model` -> the policy (LoRA adapter) that samples it and is recorded on its turns "
        "(Turn.policy); empty = one policy, the `model` field is ignored; else `model` must be one of the keys",
    )
    default_policy: str | None = Field(default=None, min_length=1,
        description="the policy that samples a request whose `model` is not a key of model_policies (None: such a "
        "request is a 404); a run with policies: sets it to the policy its agents: gives the agent",
    )

    @model_validator(mode="after")
    def _token_off_loopback(self) -> GatewayConfig:
        if not is_loopback(self.host) and not self.token:
            raise ValueError(
                f"gateway.host={self.host!r} is not a loopback address: set gateway.token (>= 16 chars) so that "
                "only callers holding it (or a session key) can use the engine"
            )
        return self

    @model_validator(mode="after")
    def _policy_names(self) -> GatewayConfig:
        for model, policy in self.model_policies.items():
            if not model or not policy:
                raise ValueError(f"gateway.model_policies: {model!r}: {policy!r}: model and policy names must be non-empty")
        return self

    def policy_of(self, model: str) -> str | None:
        """The policy that samples a request naming `model` (None: no mapping, the engine's own weights); a model
        that is no key of `model_policies` gets `default_policy`, or without one a 404 naming the served models."""
        if not self.model_policies:
            return self.default_policy
        policy = self.model_policies.get(model, self.default_policy)
        if policy is None:
            served = ", ".join(repr(m) for m in self.model_policies)
            raise GatewayError(404, f"model {model!r} is not served here; the models are {served} (one per policy, "
                               "gateway.model_policies)", param="model", code="model_not_found")
        return policy
