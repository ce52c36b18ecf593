"""Where per-step metrics go: JSONL always, TensorBoard always, W&B/MLflow on request.

Each sink has one job and the `MetricsLog` fans out to them. The JSONL file is
the source of truth (`agentrl plot` and the replay UI read it); the others are
conveniences. A sink that fails to start is reported once and skipped: losing
a dashboard must never stop a training run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from agentrl.errors import AgentrlError

log = logging.getLogger(__name__)


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step, flushed at once so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files under RUN/tensorboard (torch's writer, loaded lazily)."""

    def __init__(self, path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(path))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, when the package is installed and `wandb` is asked for."""

    def __init__(self, project: str, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=name, config=dict(config))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow, when the package is installed and `mlflow` is asked for."""

    def __init__(self, experiment: str, name: str, config: Mapping[str, Any]) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


LOGGER_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each optional logger needs (jsonl needs none)."""


def check_loggers(loggers: Sequence[str]) -> None:
    """Fail before a run starts when a logger it asks for is not installed.

    Asking for wandb and getting nothing logged is a no-op found hours later;
    a logger that is installed but fails to start (no network, no login) is
    still only disabled with a warning, so a dashboard never stops training.
    """
    missing = [name for name in loggers if name in LOGGER_PACKAGES
               and importlib.util.find_spec(LOGGER_PACKAGES[name]) is None]
    if missing:
        install = " ".join(LOGGER_PACKAGES[name] for name in missing)
        raise AgentrlError(f"run.loggers: {', '.join(missing)} not installed (pip install {install}), or drop it")


class MetricsLog:
    """Fans metrics out to the configured sinks."""

    def __init__(
        self,
        run_dir: Path,
        *,
        loggers: Sequence[str],
        project: str,
        name: str,
        config: Mapping[str, Any],
        console: Console | None = None,
    ) -> None:
        self.console = console or Console(stderr=True)
        self._sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
        factories: dict[str, Callable[[], Sink]] = {
            "tensorboard": lambda: TensorBoardSink(run_dir / "tensorboard"),
            "wandb": lambda: WandbSink(project, name, config),
            "mlflow": lambda: MlflowSink(project, name, config),
        }
        for name_ in loggers:
            if name_ == "jsonl":
                continue
            try:
                self._sinks.append(factories[name_]())
            except Exception as e:  # a dashboard must not stop training
                self.console.print(f"[yellow]metrics: {name_} disabled ({type(e).__name__}: {e})[/]")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        for sink in self._sinks:
            sink.write(step, clean)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """All rows of a run's metrics.jsonl (a torn last line from a crash is skipped)."""
    rows: list[dict[str, float]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
