"""`agentrl sandbox ...`: build the default image, run code in a backend.

Also runnable without the main CLI: ``python -m agentrl.sandboxes.cli build-image``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from agentrl.errors import AgentrlError

from .base import ExecRequest, ExecResult, Sandbox

BACKENDS = ("local", "docker", "e2b", "sandboxfusion")


def make_sandbox(backend: str, params: dict[str, Any]) -> Sandbox:
    """The sandbox plugin `backend` (built-in or the user's) with params validated by its Config."""
    from agentrl.registry import Plugins

    sandbox: Sandbox = Plugins.discover().create_sandbox(backend, params)
    return sandbox


def _params(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def register(app: typer.Typer) -> None:
    """Add the `sandbox` command group to the `agentrl` app."""
    sandbox = typer.Typer(help="Sandboxed code execution: build the image, run code.", no_args_is_help=True)

    @sandbox.command("build-image")
    def build_image_cmd(
        tag: Annotated[str, typer.Option(help="Image tag.")] = "agentrl/python:3.11",
        method: Annotated[str, typer.Option(help="auto | debootstrap | dockerfile")] = "auto",
        mirror: Annotated[str, typer.Option(help="Debian mirror for debootstrap.")] = "http://deb.debian.org/debian",
        rootfs: Annotated[Path | None, typer.Option(help="Keep/reuse the debootstrap tree here.")] = None,
        force: Annotated[bool, typer.Option(help="Rebuild even if the image exists.")] = False,
    ) -> None:
        """Build the default docker sandbox image locally (never pulls)."""
        from .images import build_image

        if method not in ("auto", "debootstrap", "dockerfile"):
            raise typer.BadParameter(f"--method {method!r}: choose auto, debootstrap or dockerfile")
        try:
            built = build_image(tag, method=method, mirror=mirror, rootfs=rootfs, force=force)  # type: ignore[arg-type]
        except Exception as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(1) from None
        typer.echo(built)

    @sandbox.command("run")
    def run_cmd(
        file: Annotated[Path | None, typer.Argument(help="Code file to run ('-' or nothing: stdin).")] = None,
        backend: Annotated[str, typer.Option("--backend", "-b", help=" | ".join(BACKENDS) + ", or a user's sandbox plugin (agentrl list sandboxes)")] = "local",
        language: Annotated[str, typer.Option("--language", "-l")] = "python",
        timeout: Annotated[float, typer.Option(help="Wall timeout in seconds.")] = 10.0,
        memory_mb: Annotated[int, typer.Option()] = 512,
        stdin: Annotated[str, typer.Option(help="Text fed to the program's stdin.")] = "",
        set_: Annotated[list[str] | None, typer.Option("--set", help="Backend param key=value (repeatable).")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON.")] = False,
    ) -> None:
        """Run code in a sandbox and print its output; exit code 0 only when status is ok."""
        try:
            code = sys.stdin.read() if file is None or str(file) == "-" else file.read_text()
        except OSError as e:
            raise AgentrlError(f"cannot read {file}: {e.strerror or e}") from None
        request = ExecRequest(code=code, language=language, wall_timeout_s=timeout,  # type: ignore[arg-type]
                              memory_mb=memory_mb, stdin=stdin)

        async def go() -> ExecResult:
            async with make_sandbox(backend, _params(set_)) as sb:
                return await sb.run(request)

        result = asyncio.run(go())
        if as_json:
            typer.echo(result.model_dump_json(indent=2, exclude={"files"}))
        else:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            typer.secho(f"[{result.status}] exit={result.exit_code} wall={result.wall_s:.3f}s {result.message}",
                        err=True, fg="green" if result.ok else "red")
        raise typer.Exit(0 if result.ok else 1)

    app.add_typer(sandbox, name="sandbox")


def main() -> None:
    """``python -m agentrl.sandboxes.cli build-image`` == ``agentrl sandbox build-image``."""
    app = typer.Typer()
    register(app)
    app(args=["sandbox", *sys.argv[1:]])


if __name__ == "__main__":
    main()
