"""Live training progress in the terminal: a bar plus one line per step."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    """Shows step, reward mean/std, tokens/s, staleness, errors and the ETA."""

    def __init__(self, total_steps: int, *, start_step: int = 0, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[summary]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, summary="")

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        line = summarize(step, metrics)
        self._progress.update(self._task, completed=step, summary=line)
        self._progress.console.print(line, highlight=False)


def summarize(step: int, m: Mapping[str, float]) -> str:
    """One human line for a step's metrics (missing ones are left out)."""
    parts = [f"step {step}"]
    if "reward/mean" in m:
        parts.append(f"reward {m['reward/mean']:.3f}±{m.get('reward/std', 0.0):.3f}")
    if "eval/reward_mean" in m:
        parts.append(f"eval {m['eval/reward_mean']:.3f}")
    if "rollout/tokens_per_s" in m:
        parts.append(f"{m['rollout/tokens_per_s']:.0f} tok/s")
    if "staleness/mean" in m:
        parts.append(f"stale {m['staleness/mean']:.2f}")
    errors = sum(v for k, v in m.items() if k.startswith("errors/"))
    if errors:
        parts.append(f"[red]errors {errors:.0f}[/]")
    if "time/step_s" in m:
        parts.append(f"{m['time/step_s']:.1f}s/step")
    return "  ".join(parts)
