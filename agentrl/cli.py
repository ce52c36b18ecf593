"""The `agentrl` command: list plugins, check envs, show configs, train.

Other areas add their own commands through modules exposing
`register(app: typer.Typer) -> None` (see `CONTRIBUTED`); a module that does
not exist (yet) is skipped. Errors a user can fix (a bad config, an unknown
plugin) print one red line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentrl.errors import AgentrlError

CONTRIBUTED = ("agentrl.replay.cli", "agentrl.sandboxes.cli", "agentrl.run.commands", "agentrl.gateway.cli")
EXIT_USAGE = 2
EXIT_CHECK_FAILED = 1

F = TypeVar("F", bound=Callable[..., Any])

PluginOption = Annotated[
    list[str] | None,
    typer.Option("--plugin", "-p", help="Import this module for its plugins (repeatable)."),
]


def _err(message: str, style: str = "red") -> None:
    Console(stderr=True, soft_wrap=True, highlight=False).print(Text(message, style=style))


def clean_errors(fn: F) -> F:
    """Turn user-fixable errors into one red line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AgentrlError as e:
            _err(f"error: {e}")
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper  # type: ignore[return-value]


def _discover(modules: list[str] | None) -> Any:
    """Plugins from entry points plus `modules` (importable from the working directory)."""
    from agentrl.config import on_path
    from agentrl.registry import Plugins

    with on_path(Path.cwd()):
        return Plugins.discover(modules=modules or [])


def _kind(kind: str) -> str:
    from agentrl.registry import KINDS, SINGULAR

    singular_to_kind = {v.replace(" ", "_"): k for k, v in SINGULAR.items()}
    return singular_to_kind.get(kind, kind) if kind not in KINDS else kind


def list_plugins(
    kind: Annotated[
        str | None,
        typer.Argument(help="envs, tools, rewards, sandboxes, engines, trainers or tool_parsers (default: all)."),
    ] = None,
    plugin: PluginOption = None,
    sources: Annotated[bool, typer.Option("--sources", help="Also show where each plugin comes from.")] = False,
) -> None:
    """List installed plugins with one-line descriptions."""
    from agentrl.registry import KINDS

    plugins = _discover(plugin)
    kinds = [plugins.registry(_kind(kind)).kind] if kind else list(KINDS)
    console = Console(soft_wrap=False)
    for k in kinds:
        table = Table(title=k, title_justify="left", show_edge=False, expand=False)
        table.add_column("name", style="bold cyan", no_wrap=True)
        table.add_column("description", overflow="fold")
        if sources:
            table.add_column("source", style="dim", overflow="fold")
        rows = plugins.registry(k).rows()
        for name, description, source in rows:
            table.add_row(name, description, *([source] if sources else []))
        if rows:
            console.print(table)
        else:
            console.print(Text(f"{k}: none installed", style="dim"))


def _parse_params(params: list[str] | None) -> dict[str, Any]:
    from agentrl.config import apply_overrides

    return apply_overrides({}, params or [])


def check_env_command(
    name: Annotated[str, typer.Argument(help="Env name (as in `agentrl list envs`) or 'module:Class'.")],
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-P", help="Env parameter key=value (YAML value; repeatable)."),
    ] = None,
    plugin: PluginOption = None,
    episodes: Annotated[int, typer.Option(help="Episodes to run with a trivial policy.", min=1)] = 2,
    split: Annotated[str, typer.Option(help="Task split to draw tasks from.")] = "train",
    timeout: Annotated[float, typer.Option(help="Deadline in seconds for each env call.")] = 30.0,
) -> None:
    """Check an env against the agentrl env contract (like gymnasium's env_checker)."""
    from agentrl.envkit.check import EnvCheckError, check_env

    plugins = _discover(plugin)
    env = plugins.create_env(name, _parse_params(param))
    try:
        report = check_env(env, n_episodes=episodes, split=split, timeout_s=timeout)
    except EnvCheckError as e:
        _err(str(e))
        raise typer.Exit(EXIT_CHECK_FAILED) from None
    for warning in report.warnings:
        _err(f"warning: {warning}", style="yellow")
    typer.echo(
        f"ok: env {name!r} passed: {report.tasks_checked} tasks, {report.episodes} episodes, {report.steps} steps"
    )


ConfigArg = Annotated[Path, typer.Argument(help="Run config YAML file.")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Overrides key.path=value, e.g. rollout.group_size=4.")
]


def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the fully resolved config (every default filled in) as YAML."""
    from agentrl.config import dump_config, load_config

    typer.echo(dump_config(load_config(config, overrides or [])), nl=False)


def config_explain(
    config: Annotated[
        str | None,
        typer.Argument(help="Run config YAML file; may be left out when overrides name the env (env.name=math)."),
    ] = None,
    overrides: OverridesArg = None,
    key: Annotated[
        str | None, typer.Option("--key", "-k", help="Only this key or section, e.g. rollout or trainer.kl.")
    ] = None,
    changed: Annotated[bool, typer.Option("--changed", help="Only keys set to something else than their default.")] = False,
) -> None:
    """Explain every config key: value, type, allowed values, limits, default and meaning."""
    from agentrl.config import load_config, resolve_config
    from agentrl.config_explain import explain, format_docs

    overrides = list(overrides or [])
    if config is not None and "=" in config and not Path(config).exists():  # no file, overrides only
        overrides.insert(0, config)
        config = None
    if config is None and not any(o.split("=", 1)[0].strip() in ("env", "env.name") for o in overrides):
        raise AgentrlError("config explain needs a CONFIG file or an env to explain, e.g. "
                           "`agentrl config explain env.name=calculator` (`agentrl list envs` shows them)")
    run_config = load_config(config, overrides) if config is not None else resolve_config({}, overrides)
    docs = explain(run_config, key or "")
    typer.echo(format_docs([d for d in docs if d.changed] if changed else docs), nl=False)


def config_diff(
    a: Annotated[Path, typer.Argument(help="A run config YAML file or a run directory.")],
    b: Annotated[Path, typer.Argument(help="The one to compare it with.")],
) -> None:
    """Print the keys two configs (or two runs) set differently: `path: A -> B`."""
    from agentrl.config import load_config
    from agentrl.config_explain import differences, format_differences

    typer.echo(format_differences(differences(load_config(a), load_config(b))), nl=False)


def train(
    config: Annotated[Path | None, typer.Argument(help="Run config YAML (omit with --resume).")] = None,
    overrides: OverridesArg = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this directory (after Ctrl-C, a crash or kill -9).")
    ] = None,
) -> None:
    """Train with CONFIG (plus overrides), or resume a run where it stopped."""
    from agentrl.config import load_config

    if config is None:
        if resume is None:
            raise AgentrlError("agentrl train needs a CONFIG file, or --resume RUN_DIR")
        config = resume / "config.yaml"
        if not config.exists():
            raise AgentrlError(f"--resume {resume}: no config.yaml there; is it an agentrl run directory?")
    run_config = load_config(config, overrides or [])
    try:
        loop = importlib.import_module("agentrl.run.loop")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("agentrl"):
            raise AgentrlError(f"agentrl train is not available in this install: {e}") from None
        raise
    result = loop.train(run_config, resume=resume)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    if result is not None:
        typer.echo(f"run directory: {result}")


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _register_contributed(app: typer.Typer) -> None:
    for module_name in CONTRIBUTED:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and module_name.startswith(e.name):
                continue  # that area has not shipped its commands yet
            _err(f"warning: commands from {module_name} unavailable: {e}", style="yellow")
            continue
        register = getattr(module, "register", None)
        if callable(register):
            register(app)


def build_app() -> typer.Typer:
    """A fresh `agentrl` typer app with every built-in and contributed command."""
    app = typer.Typer(
        name="agentrl",
        help="Asynchronous agentic RL for language models.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.command("list")(list_plugins)
    app.command("check-env")(check_env_command)
    config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
    config_app.command("show")(config_show)
    config_app.command("explain")(config_explain)
    config_app.command("diff")(config_diff)
    app.add_typer(config_app, name="config")
    app.command("train")(train)
    _register_contributed(app)
    _clean_errors_everywhere(app)
    return app


def _clean_errors_everywhere(app: typer.Typer) -> None:
    """Wrap every command, contributed ones and those of sub-groups included, in `clean_errors`."""
    for command in app.registered_commands:
        if command.callback is not None:
            command.callback = clean_errors(command.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            _clean_errors_everywhere(group.typer_instance)


def main() -> None:
    """Console-script entry point."""
    build_app()()


if __name__ == "__main__":
    main()
