"""Metric sinks: jsonl always, optional loggers checked before a run, a failing dashboard never stops one."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from agentrl.errors import AgentrlError
from agentrl.run import metrics_log
from agentrl.run.metrics_log import LOGGER_PACKAGES, MetricsLog, check_loggers, read_metrics


def test_a_logger_that_is_not_installed_fails_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    check_loggers(["jsonl", "tensorboard"])  # installed with agentrl
    monkeypatch.setitem(LOGGER_PACKAGES, "wandb", "agentrl_no_such_package")
    with pytest.raises(AgentrlError) as e:
        check_loggers(["jsonl", "wandb"])
    assert str(e.value) == "run.loggers: wandb not installed (pip install agentrl_no_such_package), or drop it"


def test_jsonl_rows_round_trip_and_non_numbers_are_left_out(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, loggers=["jsonl"], project="p", name="n", config={})
    log.write(1, {"loss": 0.5, "count": 3, "note": "text", "bad": math.inf})  # type: ignore[dict-item]
    log.write(2, {"loss": 0.25})
    log.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 3, "loss"')  # a torn line, as after kill -9
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.5), (2, 0.25)]
    assert rows[0]["count"] == 3.0 and rows[0]["bad"] is None and "note" not in rows[0]


def test_an_installed_logger_that_fails_to_start_is_disabled_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object) -> None:
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(metrics_log.WandbSink, "__init__", no_network)
    out = io.StringIO()
    log = MetricsLog(tmp_path, loggers=["jsonl", "wandb"], project="p", name="n", config={},
                     console=Console(file=out, width=200))
    log.write(1, {"loss": 1.0})
    log.close()
    assert "metrics: wandb disabled (ConnectionError: api.wandb.ai unreachable)" in out.getvalue()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] == 1.0
