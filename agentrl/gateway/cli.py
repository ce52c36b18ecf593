"""`agentrl gateway CONFIG`: serve a run's engine to agents in other processes or containers.

The engine, model and rollout settings come from the run config; the gateway
settings from its `env.gateway` (when the env is `agent`), overridden by
``--host/--port/--token``. Agents open an episode with ``POST /sessions``
(optionally ``{"task": {...}}``), call ``{base_url}/chat/completions``, give a
reward with ``POST /s/{id}/reward`` and end it with ``POST /s/{id}/close``;
each closed episode's trajectories (one per branch) go into the store of a
run directory, where `agentrl replay` shows them.

This is the same `Gateway` a training run serves in remote mode (`env: {name:
agent, mode: remote}`), without the training: there the run offers the episodes
(``POST /episodes``) and agents cannot open their own (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agentrl.gateway.config import GatewayConfig, is_loopback
from agentrl.gateway.protocol import TrainerSampling
from agentrl.gateway.server import Gateway
from agentrl.gateway.session import Backend, Session

if TYPE_CHECKING:
    from agentrl.config import RunConfig
    from agentrl.store.trajectory_store import TrajectoryStore


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway_command)


def gateway_command(
    config: Annotated[Path, typer.Argument(help="Run config YAML (engine, model, rollout settings).")],
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default: env.gateway.host or 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port (default: env.gateway.port; 0 = any free port).")
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="Admin token; required off loopback (one is generated when missing).")
    ] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="Overrides key.path=value.")] = None,
) -> None:
    """Serve the run's engine as an OpenAI-compatible gateway; closed episodes are stored for replay."""
    from agentrl.config import load_config
    from agentrl.run.run_dir import RunDir

    run_config = load_config(config, overrides or [])
    settings = gateway_settings(run_config, host=host, port=port, token=token)
    run_dir = RunDir.create(Path(run_config.run.output_dir), f"{run_config.run.name}-gateway")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(run_config, settings, run_dir.store_path, stop_on_signals=True))


def gateway_settings(
    run_config: RunConfig, *, host: str | None, port: int | None, token: str | None
) -> GatewayConfig:
    """The gateway config: env.gateway of an `agent` env, then the command line; a token is made off loopback."""
    base: dict[str, Any] = {}
    if run_config.env.name == "agent":
        base = dict(run_config.env.params.get("gateway") or {})
    if host is not None:
        base["host"] = host
    if port is not None:
        base["port"] = port
    if token is not None:
        base["token"] = token
    if not is_loopback(str(base.get("host", "127.0.0.1"))) and not base.get("token"):
        base["token"] = secrets.token_urlsafe(24)
    return GatewayConfig.model_validate(base)


def build_backend(run_config: RunConfig, gateway: GatewayConfig) -> Backend:
    """The run's engine, chat template and rollout settings behind a gateway."""
    from agentrl.chat.conversation import Budgets, HFChatTokenizer
    from agentrl.chat.tool_parsers import get_parser
    from agentrl.engines.models import resolve_model

    plugins = run_config.registry()
    model_path = resolve_model(run_config.model.path)
    tokenizer = HFChatTokenizer.from_pretrained(model_path)
    params = dict(run_config.engine.params)
    if "model" in plugins.engines.get(run_config.engine.name).Config.model_fields:
        params["model"] = model_path
    engine = plugins.create_engine(run_config.engine.name, params, tokenizer=tokenizer)
    rollout = run_config.rollout
    s = rollout.sampling
    return Backend(
        engine=engine,
        tokenizer=tokenizer,
        parser=get_parser(gateway.tool_parser, plugins),
        sampling=TrainerSampling(s.temperature, s.top_p, s.top_k),
        budgets=Budgets.from_rollout_config(rollout),
        stop_strings=tuple(s.stop_strings),
        generate_timeout_s=rollout.generate_timeout_s,
        tools_in_prompt=gateway.tools_in_prompt,
    )


def store_on_close(store: TrajectoryStore) -> Any:
    """A close hook that writes a session's trajectories (reward: what was POSTed, else 0) into `store`."""

    async def on_close(session: Session) -> dict[str, Any]:
        reward = session.reward if session.reward is not None else 0.0
        trajs = session.trajectories(
            task=session.task, env="agent", group_id=session.id, reward=reward, breakdown=session.breakdown
        )
        for traj in trajs:
            store.add_trajectory(traj, step=None, status="gateway")
        store.commit()
        return {"trajectories": [t.id for t in trajs], "reward": reward}

    return on_close


async def serve(
    run_config: RunConfig, settings: GatewayConfig, store_path: Path, *, stop_on_signals: bool = False
) -> None:
    """Run the gateway until cancelled; with `stop_on_signals`, SIGINT and SIGTERM end it cleanly.

    The handlers are installed explicitly because a process started in the background by a
    non-interactive shell inherits SIGINT as ignored, and `docker stop` / systemd send SIGTERM.
    """
    from agentrl.store.trajectory_store import TrajectoryStore

    stop = asyncio.Event()
    if stop_on_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    backend = build_backend(run_config, settings)
    store = TrajectoryStore(store_path)
    try:
        async with Gateway(settings, backend, on_close=store_on_close(store)) as gateway:
            typer.echo(
                f"agentrl gateway: {gateway.url}  (POST /sessions to open an episode; store {store_path})"
            )
            if settings.token:
                typer.echo(f"admin token: {settings.token}")
            await stop.wait()
    finally:
        store.close()
        await backend.engine.close()
