"""Turn-level credit on a real model: grpo vs turn_rloo vs gigpo, same config, same seeds.

`benchmarks/credit_assignment.py` measures the estimators exactly on a toy;
this one trains a real policy. It runs `agentrl train CONFIG` once per
(estimator, seed), changing only `trainer.advantage`, `run.seed` and the run's
folder, then reads each run's metrics.jsonl and reports the held-out reward
(`eval/reward_mean`; the success rate for FrozenLake, whose reward is 1 at the
goal and 0 otherwise):

- at fixed step budgets: every step the runs evaluated at (robust to machine load);
- at a fixed wall-clock budget: the last evaluation finished within
  `--wall-budget-s` of its run's start (model loading included). Concurrent runs
  share the CPU, so compare these only between runs launched together.

Each run's wall time, its process tree's CPU seconds and the load average
seen while it ran are reported beside, since a shared machine inflates wall
time. Nothing here asserts that anything learned: machines are noisy, the
numbers are for reading.

    python benchmarks/credit_on_model.py                      # examples/frozenlake.yaml, seed 0, concurrently
    python benchmarks/credit_on_model.py --seeds 0,1 --sequential trainer.lr=2e-4
    python benchmarks/credit_on_model.py --summarize runs/credit   # re-read finished runs

Summary line (the mean over seeds at the last step every run reached):
heldout_grpo=... heldout_turn_rloo=... heldout_gigpo=... start_grpo=... ... steps=... wall_s=...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ESTIMATORS = ("grpo", "turn_rloo", "gigpo")
RESULT = "credit_run.json"  # written into each run's folder: wall time, CPU seconds, load


@dataclass
class RunSpec:
    """One training run of the comparison."""

    estimator: str
    seed: int
    path: Path

    @property
    def name(self) -> str:
        return f"{self.estimator}-s{self.seed}"


@dataclass
class RunResult:
    """What one run left behind: its held-out curve and how long it took."""

    spec: RunSpec
    evals: list[tuple[int, float, float | None]] = field(default_factory=list)  # (step, reward, wall s)
    wall_s: float | None = None
    cpu_s: float | None = None
    load: list[float] = field(default_factory=list)
    returncode: int | None = None

    def at_step(self, step: int) -> float | None:
        return next((r for s, r, _ in self.evals if s == step), None)

    def within(self, wall_s: float) -> tuple[int, float] | None:
        """(step, reward) of the last evaluation finished within `wall_s` seconds of the run's start."""
        done = [(s, r) for s, r, w in self.evals if w is not None and w <= wall_s]
        return done[-1] if done else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "frozenlake.yaml"), help="run config YAML")
    p.add_argument("--estimators", default=",".join(ESTIMATORS), help="comma-separated, of: " + ", ".join(ESTIMATORS))
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values (each estimator runs each)")
    p.add_argument("--out", default="runs/credit", help="folder of the runs (one sub-folder per estimator and seed)")
    p.add_argument("--sequential", action="store_true", help="one run at a time (default: all at once)")
    p.add_argument("--wall-budget-s", type=float, default=None, help="also report held-out reward within this time")
    p.add_argument("--timeout-s", type=float, default=None, help="stop a run after this long (counted as finished: the summary reads the evals it reached)")
    p.add_argument(
        "--threads", type=int, default=0, help="OMP_NUM_THREADS of each run (0 = unset); 1 suits concurrent runs on few cores"
    )
    p.add_argument("--summarize", metavar="DIR", default=None, help="only read finished runs in DIR")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, key.path=value")
    args = p.parse_args(argv)
    args.estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    unknown = [e for e in args.estimators if e not in ESTIMATORS]
    if unknown or not args.estimators:
        raise SystemExit(f"--estimators: got {unknown or 'none'}; allowed: {', '.join(ESTIMATORS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds: got {args.seeds!r}; give comma-separated integers, e.g. 0,1") from None
    for o in args.overrides:
        key = o.split("=", 1)[0]
        if "=" not in o or key in {"trainer.advantage", "run.seed", "run.name", "run.output_dir"}:
            raise SystemExit(f"override {o!r}: give key.path=value, not one of the keys the harness sets per run")
    return args


def specs(args: argparse.Namespace) -> list[RunSpec]:
    out = Path(args.out)
    return [RunSpec(e, s, out / f"{e}-s{s}") for s in args.seeds for e in args.estimators]


def train_command(args: argparse.Namespace, spec: RunSpec) -> list[str]:
    """`agentrl train` with the shared overrides and the run's own estimator, seed and folder."""
    return [
        sys.executable, "-m", "agentrl.cli", "train", args.config, *args.overrides,
        f"trainer.advantage={spec.estimator}", f"run.seed={spec.seed}",
        f"run.output_dir={spec.path.parent}", f"run.name={spec.path.name}",
    ]  # fmt: skip


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))  # fields[1]: ppid
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


def launch(args: argparse.Namespace, batch: list[RunSpec]) -> None:
    """Run a batch of trainings at once; write each run's wall time, CPU seconds and load samples."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.threads:  # concurrent runs each spinning up all cores' worth of threads only thrash
        env |= {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    procs: list[tuple[RunSpec, subprocess.Popen[bytes], float]] = []
    for spec in batch:
        if spec.path.exists():
            raise SystemExit(f"{spec.path} exists: pick another --out (the harness never mixes runs)")
        spec.path.parent.mkdir(parents=True, exist_ok=True)
        log = (spec.path.parent / f"{spec.name}.log").open("wb")
        proc = subprocess.Popen(train_command(args, spec), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((spec, proc, time.monotonic()))
    cpu = {spec.name: 0.0 for spec, _, _ in procs}
    load: list[float] = []
    stop = threading.Event()

    def sample() -> None:  # CPU seconds are read while the process tree is alive; load every 30 s
        ticks = 0
        while not stop.wait(2.0):
            for spec, proc, _ in procs:
                if proc.poll() is None:
                    cpu[spec.name] = max(cpu[spec.name], _cpu_seconds(proc.pid))
            if ticks % 15 == 0:
                load.append(os.getloadavg()[0])
            ticks += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    running = list(procs)
    while running:  # poll them all, so each run's wall time ends when that run does
        for item in list(running):
            spec, proc, started = item
            code = proc.poll()
            timed_out = code is None and args.timeout_s is not None and time.monotonic() - started > args.timeout_s
            if timed_out:
                proc.terminate()  # the run keeps its metrics and checkpoints; the summary reads what it reached
                proc.wait(timeout=60)
                code = 0
            if code is None:
                continue
            running.remove(item)
            record = {
                "wall_s": time.monotonic() - started, "returncode": code, "timed_out": timed_out,
                "command": train_command(args, spec),
            }  # fmt: skip
            (spec.path.parent / f"{spec.name}.{RESULT}").write_text(json.dumps(record), encoding="utf-8")
        time.sleep(1.0)
    stop.set()
    sampler.join()
    for spec, _, _ in procs:
        path = spec.path.parent / f"{spec.name}.{RESULT}"
        record = json.loads(path.read_text(encoding="utf-8"))
        record |= {"cpu_s": cpu[spec.name], "load": load}
        path.write_text(json.dumps(record), encoding="utf-8")


def read_run(spec: RunSpec) -> RunResult:
    """The held-out curve of a run (from metrics.jsonl) and the harness's record of it, if any."""
    result = RunResult(spec)
    metrics = spec.path / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                row: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:  # a torn last line
                continue
            if row.get("eval/reward_mean") is not None:
                result.evals.append((int(row["step"]), float(row["eval/reward_mean"]), row.get("time/wall_s")))
    record_path = spec.path.parent / f"{spec.name}.{RESULT}"
    if record_path.exists():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        result.wall_s, result.cpu_s = record.get("wall_s"), record.get("cpu_s")
        result.load, result.returncode = record.get("load", []), record.get("returncode")
    return result


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(results: list[RunResult], wall_budget_s: float | None) -> str:
    """A table (held-out reward per eval step, per run) and the key=value summary line, as text."""
    steps = sorted({s for r in results for s, _, _ in r.evals})
    lines = [f"{'run':<16}" + "".join(f"{'step ' + str(s):>10}" for s in steps) + f"{'wall_s':>10}{'cpu_s':>10}"]
    for r in results:
        cells = "".join(f"{_fmt(r.at_step(s)):>10}" for s in steps)
        wall = f"{r.wall_s:.0f}" if r.wall_s is not None else "-"
        cpu = f"{r.cpu_s:.0f}" if r.cpu_s is not None else "-"
        lines.append(f"{r.spec.name:<16}{cells}{wall:>10}{cpu:>10}")
    loads = [x for r in results for x in r.load]
    if loads:
        lines.append(f"load average (1 min) while the runs ran: min {min(loads):.1f}, max {max(loads):.1f}")
    # the last step every run evaluated at: the fixed step budget of the summary
    common = [s for s in steps if all(r.at_step(s) is not None for r in results)]
    last = common[-1] if common else None
    summary: dict[str, str] = {}
    for estimator in dict.fromkeys(r.spec.estimator for r in results):
        mine = [r for r in results if r.spec.estimator == estimator]
        at = [v for r in mine if last is not None and (v := r.at_step(last)) is not None]
        start = [v for r in mine if (v := r.at_step(0)) is not None]
        summary[f"heldout_{estimator}"] = _fmt(_mean(at))
        summary[f"start_{estimator}"] = _fmt(_mean(start))
        if wall_budget_s is not None:
            timed = [w[1] for r in mine if (w := r.within(wall_budget_s)) is not None]
            summary[f"heldout_{estimator}_within_{wall_budget_s:.0f}s"] = _fmt(_mean(timed))
    walls = [r.wall_s for r in results if r.wall_s is not None]
    summary["steps"] = "-" if last is None else str(last)
    summary["seeds"] = str(len({r.spec.seed for r in results}))
    summary["wall_s"] = f"{max(walls):.0f}" if walls else "-"
    lines.append(" ".join(f"{k}={v}" for k, v in summary.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        args.out = args.summarize
    runs = specs(args)
    if not args.summarize:
        batches = [[s] for s in runs] if args.sequential else [runs]
        for batch in batches:
            launch(args, batch)
    results = [read_run(s) for s in runs]
    print(report(results, args.wall_budget_s))
    failed = [r.spec.name for r in results if r.returncode not in (0, None)]
    if failed:
        print(f"runs that failed (see {Path(args.out)}/<run>.log): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
