"""`agentrl eval` and `agentrl plot`: the commands around a training run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from agentrl.config import RunConfig


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("plot")(plot_command)


def eval_command(
    config: Annotated[Path, typer.Argument(help="Run config YAML (its env and eval settings are used).")],
    checkpoint: Annotated[
        str | None,
        typer.Option(help="Checkpoint dir (RUN/checkpoints/step-N), a model dir, or an alias; default: model.path"),
    ] = None,
    samples: Annotated[int, typer.Option(help="Samples per task (pass@k for k <= samples).", min=1)] = 1,
    tasks: Annotated[
        int | None, typer.Option(help="Held-out tasks to score (default: run.eval_tasks).", min=1)
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Store the episodes and eval.json here (not in the checkpoint's run), for show/replay."),
    ] = None,
    oracle: Annotated[
        bool, typer.Option("--oracle", help="Play the env's own oracle solution instead of a model (tasks and reward check).")
    ] = False,
    overrides: Annotated[list[str] | None, typer.Argument(help="Overrides key.path=value.")] = None,
) -> None:
    """Score a model on held-out tasks: mean reward and pass@k, written into the run.

    The episodes (status `eval`) and the `eval/*` metrics are stored under the step of
    the checkpoint evaluated (its `extra_state.json`), or step 0 for a model that is not
    a checkpoint (the policy before training), so `agentrl replay` shows them.

    With `'engine={name: scripted, replies: [...]}'` and `--out DIR` this is a model-free
    harness for an env and its reward: play canned replies, then look at every episode.
    `--oracle` plays the env's own known-good solutions (terminal and Harbor tasks: solution/solve.sh)
    with no model loaded: a reward below 1.0 names a broken task or a broken reward.
    """
    from agentrl.config import load_config

    run_config = load_config(config, [*(overrides or []), *(["engine={name: scripted}"] if oracle else [])])
    if tasks is not None:
        run_config.run.eval_tasks = tasks
    run_config.run.eval_samples = samples
    model, run_dir, step = _model_and_run(checkpoint)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        run_dir = out
    if model is not None:
        run_config.model.path = model
        if run_config.engine.model_extra is not None and "model" in run_config.engine.model_extra:
            run_config.engine.model_extra["model"] = model
    result = asyncio.run(_evaluate(run_config, run_dir, step, oracle=oracle))
    typer.echo(json.dumps(result, indent=2))


async def _evaluate(run_config: RunConfig, run_dir: Path | None, step: int, *, oracle: bool = False) -> dict[str, object]:
    from agentrl.run.wiring import build_engine_only, evaluate_config
    from agentrl.store.trajectory_store import TrajectoryStore

    parts = build_engine_only(run_config)
    try:
        result = await evaluate_config(run_config, parts, oracle=oracle)
    finally:
        await parts.close()
    summary: dict[str, object] = {
        "model": "oracle" if oracle else run_config.model.path,
        "step": step,
        "env": run_config.env.name,
        "tasks": result.n_tasks,
        "samples": result.n_samples,
        **result.metrics(prefix=""),
    }
    if run_dir is not None:
        with TrajectoryStore(run_dir / "trajectories.sqlite") as store:
            for traj in result.trajectories:
                store.add_trajectory(traj, step=step, status="eval")
            store.add_metrics(step, result.metrics())  # `eval/*`, as the loop's evaluations: replay's held-out curves
            store.set_state(f"eval:{run_config.model.path}", summary)
        evals = run_dir / "eval.json"
        history = json.loads(evals.read_text()) if evals.exists() else []
        evals.write_text(json.dumps([*history, summary], indent=2))
    return summary


def _model_and_run(checkpoint: str | None) -> tuple[str | None, Path | None, int]:
    """A checkpoint dir resolves to its HF model folder, the run it belongs to and its step.

    A model that is not a checkpoint (a model dir, an alias, none) is step 0: the policy before training.
    """
    if checkpoint is None:
        return None, None, 0
    path = Path(checkpoint)
    if (path / "model" / "config.json").exists():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return str(path / "model"), run_dir, _checkpoint_step(path)
    if path.exists() and not (path / "config.json").exists():
        raise AgentrlError(f"--checkpoint {checkpoint}: neither a checkpoint nor a model directory")
    return checkpoint, None, 0


def _checkpoint_step(path: Path) -> int:
    """The loop's step a checkpoint was saved at (`extra_state.json`), else the N of its `step-N` name, else 0."""
    extra = path / "extra_state.json"
    if extra.exists():
        try:
            step = json.loads(extra.read_text()).get("step")
        except (OSError, ValueError, AttributeError) as e:
            raise AgentrlError(f"--checkpoint {path}: cannot read {extra.name} ({e})") from None
        if isinstance(step, int):
            return step
    name = path.name.removeprefix("step-")
    return int(name) if name.isdigit() else 0


def plot_command(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    out: Annotated[Path | None, typer.Option(help="PNG path (default RUN/curves.png).")] = None,
) -> None:
    """Draw reward and the key metrics of a run to a PNG."""
    from agentrl.run.plot import plot_run

    try:
        path = plot_run(run, out)
    except FileNotFoundError as e:
        raise AgentrlError(str(e)) from None
    typer.echo(str(path))
