"""`agentrl replay` (the web inspector, or `--check` re-execution) and `agentrl show` (terminal view)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sqlite3
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agentrl.replay.queries import TrajectoryQueries
from agentrl.store.summary import prompt_layout
from agentrl.store.trajectory_store import resolve_store_path, upgrade_store
from agentrl.types import Trajectory

EXIT_USAGE = 2
EXIT_CHECK_FAILED = 1

RunArg = Annotated[Path, typer.Argument(help="Run directory (or its trajectories.sqlite).")]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        help="Tokenizer for token text: 'simple', 'none', or a model path/alias (default: the run's model)."
    ),
]


def register(app: typer.Typer) -> None:
    """Add `replay` and `show` to the `agentrl` command."""
    app.command("replay")(replay)
    app.command("show")(show)


def _open_store(run: Path) -> TrajectoryQueries:
    """The run's store, read-only; one written by an older agentrl is upgraded in place first."""
    path = resolve_store_path(run)
    err = Console(stderr=True)
    try:
        old = upgrade_store(path)
        if old is not None:
            err.print(Text(f"upgraded {path} from store schema {old} (episode counts, previews, search)"))
        return TrajectoryQueries.open(path)
    except (FileNotFoundError, ValueError) as e:
        err.print(Text(f"error: {e}", style="red"))
        raise typer.Exit(EXIT_USAGE) from None
    except (PermissionError, sqlite3.OperationalError) as e:
        err.print(Text(f"error: {path} was written by an older agentrl and upgrading it needs write access ({e})",
                       style="red"))  # fmt: skip
        raise typer.Exit(EXIT_USAGE) from None


def replay(
    run: RunArg,
    host: Annotated[
        str, typer.Option(help="Address to bind; anything but loopback requires an access token.")
    ] = ("127.0.0.1"),
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(help="Access token to require (default: a random one on non-loopback binds)."),
    ] = None,
    tokenizer: TokenizerOpt = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="Re-execute trajectory --id against its env and report; no server."),
    ] = False,
    id: Annotated[str | None, typer.Option("--id", help="Trajectory id (for --check).")] = None,
) -> None:
    """Serve the interactive trajectory inspector for RUN (live while training writes)."""
    if check:
        if not id:
            Console(stderr=True).print(Text("error: --check needs --id TRAJECTORY_ID", style="red"))
            raise typer.Exit(EXIT_USAGE)
        raise typer.Exit(_check(run, id))
    from agentrl.replay.server import serve, settings_for_bind

    _open_store(run).close()  # fail early and clearly on a bad path
    settings = settings_for_bind(resolve_store_path(run), host, port, token=token, tokenizer=tokenizer)
    console = Console()

    def ready(url: str) -> None:
        console.print(Text("agentrl replay serving ", style="bold") + Text(str(settings.store_path)))
        console.print(Text("open ") + Text(url, style="bold cyan"))
        if settings.token:
            console.print(Text(f"access token: {settings.token}", style="yellow"))
        console.print(Text("read-only; Ctrl-C to stop", style="dim"))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, host, port, on_ready=ready))


def _check(run: Path, traj_id: str) -> int:
    from agentrl.replay.reexec import default_env_factory, recheck

    with _open_store(run) as q:
        try:
            traj = q.store.get_trajectory(traj_id)
        except KeyError as e:
            Console(stderr=True).print(Text(f"error: {e.args[0]}", style="red"))
            return EXIT_USAGE
        config = q.store.run_config()
    report = asyncio.run(recheck(traj, default_env_factory(config)))
    console = Console()
    table = Table("step", "result", "reward stored", "reward replayed", "note")
    for s in report.steps:
        table.add_row(
            "reset" if s.turn is None else f"turn {s.turn}",
            Text("reproduced", style="green") if s.ok else Text("differs", style="red"),
            _num(s.reward_stored),
            _num(s.reward_replayed),
            Text(s.note),
        )
    console.print(table)
    for s in report.steps:
        if not s.ok:
            console.print(Text(f"{'reset' if s.turn is None else f'turn {s.turn}'} stored:", style="bold"))
            console.print(Text(repr(s.stored)))
            console.print(Text("replayed:", style="bold"))
            console.print(Text(repr(s.replayed)))
    if report.error:
        console.print(Text(f"error: {report.error}", style="red"))
    verdict = "reproduces" if report.ok else "does NOT reproduce"
    console.print(
        Text(f"{traj_id}: {verdict} (reward stored {_num(report.reward_stored)}, "
             f"replayed {_num(report.reward_replayed)})", style="bold green" if report.ok else "bold red")
    )  # fmt: skip
    return 0 if report.ok else EXIT_CHECK_FAILED


def show(
    run: RunArg,
    id: Annotated[str | None, typer.Option("--id", help="Trajectory id (default: the newest one).")] = None,
    tokens: Annotated[bool, typer.Option(help="Print the tokens, coloured by loss mask.")] = True,
    colour: Annotated[str, typer.Option(help="Token colouring: mask, logprob or version.")] = "mask",
    list_: Annotated[int, typer.Option("--list", help="List the newest N trajectories instead.")] = 0,
    demos: Annotated[bool, typer.Option(help="Print the prompt's few-shot demonstrations in full.")] = False,
    tokenizer: TokenizerOpt = None,
) -> None:
    """Print one trajectory (conversation + loss-masked tokens) in the terminal."""
    from agentrl.replay.tokens import TokenDecoder

    if colour not in ("mask", "logprob", "version"):
        Console(stderr=True).print(
            Text(f"error: --colour {colour!r}: expected mask, logprob or version", style="red")
        )
        raise typer.Exit(EXIT_USAGE)
    console = Console()
    with _open_store(run) as q:
        store = q.store
        if list_:
            _print_list(console, q.query(limit=min(list_, 1000)))
            return
        if id is None:
            newest = q.query(limit=1)
            if not newest:
                console.print(Text("the store holds no trajectories yet", style="yellow"))
                return
            id = str(newest[0]["id"])
        try:
            record = store.get_record(id)
        except KeyError as e:
            Console(stderr=True).print(Text(f"error: {e.args[0]}", style="red"))
            raise typer.Exit(EXIT_USAGE) from None
        decoder = TokenDecoder.for_run(store.run_config(), tokenizer)
    t = record.trajectory
    console.print(_header(t, record.step, record.status))
    layout = prompt_layout(t)
    turn = -1
    for i, m in enumerate(t.messages):
        if i == layout.system_end and layout.task_start > i and not demos:
            n = layout.task_start - layout.system_end
            console.print(
                Text(f"prompt: {n} few-shot demonstration messages (--demos to print them)", style="dim")
            )
        if layout.system_end <= i < layout.task_start and not demos:
            continue
        body: list[Any] = [Text(m.content)]
        for c in m.tool_calls:
            body.append(Text(f"→ {c.name}({c.arguments})" + (f"  [parse error: {c.error}]" if c.error else ""),
                             style="cyan"))  # fmt: skip
        title = m.role + (f" · {m.name}" if m.name else "")
        if i < layout.prompt_end:
            part = "task"
            if i < layout.task_start:
                part = "system prompt" if i < layout.system_end else "demonstration"
            title = f"{title} · prompt ({part})"
        elif m.role == "assistant":
            turn += 1
            title = f"{title} · turn {turn}"
        console.print(
            Panel(Group(*body), title=Text(title), title_align="left", border_style=_ROLE_STYLE[m.role])
        )
    if tokens:
        console.print(Text(f"tokens ({len(t.token_ids)}, {sum(t.loss_mask)} sampled; tokenizer {decoder.name}):",
                           style="bold"))  # fmt: skip
        console.print(_token_text(t, decoder, colour))


_ROLE_STYLE = {"system": "white", "user": "blue", "assistant": "green", "tool": "yellow"}


def _header(t: Trajectory, step: int | None, status: str) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    rows = [
        ("id", t.id), ("task", t.task_id), ("env", t.env), ("step", str(step)), ("status", status),
        ("reward", _num(t.reward) + ("  " + ", ".join(f"{k}={_num(v)}" for k, v in t.reward_breakdown.items())
                                     if t.reward_breakdown else "")),
        ("ended", "terminated" if t.terminated else f"truncated ({t.truncation_reason})" if t.truncated else "open"),
        ("group", f"{t.group_id} #{t.sample_index}"),
    ]  # fmt: skip
    if t.error:
        rows.append(("error", f"{t.error.kind.value}: {t.error.message}"))
    for k, v in rows:
        table.add_row(k, Text(v))
    return table


def _token_text(t: Trajectory, decoder: Any, colour: str) -> Text:
    out = Text()
    for i, token_id in enumerate(t.token_ids):
        piece = decoder.text(token_id)
        piece = f"⟨{token_id}⟩" if piece is None else piece
        if not t.loss_mask[i]:
            style = "dim"
        elif colour == "logprob":
            p = math.exp(max(t.logprobs[i], -20.0)) if math.isfinite(t.logprobs[i]) else 0.0
            style = "black on green" if p > 0.66 else "black on yellow" if p > 0.33 else "white on red"
        elif colour == "version":
            style = f"black on {('cyan', 'magenta', 'yellow', 'green', 'blue', 'red')[t.versions[i] % 6]}"
        else:
            style = "bold black on green"
        out.append(piece, style=style)
    return out


def _print_list(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table("id", "step", "env", "status", "reward", "tokens", "turns", "calls", "flags", "preview")
    for r in rows:
        flags = " ".join(x for x in (r["error_class"], "truncated" if r["truncated"] else None) if x)
        table.add_row(*(Text(str(v)) for v in (r["id"], r["step"], r["env"], r["status"], _num(r["reward"]),
                                               r["num_tokens"], r["num_turns"], r["num_tool_calls"], flags,
                                               r["preview"][:60])))  # fmt: skip
    console.print(table)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"
