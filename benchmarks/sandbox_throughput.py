"""Isolated executions per second of a short Python test, on this machine, in one run.

Compared in the same run:
  - local warm pool   (bubblewrap + fork server, pool = CPU count)   <- the default backend
  - local fresh       (one new bubblewrap + python per execution)
  - subprocess        (naive `subprocess.run([python, -c, ...])`, no isolation at all)
  - docker warm pool  (`docker exec` into warm locked-down containers), when a daemon is up
  - docker server     (the fork server as each warm container's PID 1, mode: server)
  - docker run        (`docker run --rm` per execution), when a daemon is up

Throughput: many concurrent callers for ~`--seconds` each. Latency (p50/p95):
one caller at a time, so it is the cost of one isolated execution, not queueing.
Ends with one line: local_pool_per_s=... p50_ms=... vs_fresh=... (and the rest).
Goal: >= 300 executions/s with p50 <= 5 ms on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.sandboxes.base import ExecRequest, ExecResult

TEST = "def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n"


async def throughput(run: Callable[[], Awaitable[bool]], seconds: float, callers: int) -> tuple[float, int]:
    """Executions per second with `callers` concurrent loops; also returns the failure count."""
    done = 0
    failed = 0
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done, failed
        while time.perf_counter() < stop:
            ok = await run()
            done += 1
            failed += not ok

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(callers)))
    return done / (time.perf_counter() - t0), failed


async def latency(run: Callable[[], Awaitable[bool]], n: int) -> tuple[float, float]:
    """p50 and p95 in ms of `n` sequential executions."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await run()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def tree_cpu_s(root_pids: list[int]) -> float:
    """CPU seconds used so far by these processes and all their descendants (incl. reaped children)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            parents[int(name)] = int(fields[1])
            cpu[int(name)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    found = set(root_pids)
    frontier = set(root_pids)
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in found}
        found |= frontier
    return sum(cpu.get(p, 0.0) for p in found)


async def cpu_per_exec(sb: Any, run: Callable[[], Awaitable[bool]], n: int) -> float:
    """CPU ms per execution (sandbox processes + this host process): independent of machine load."""
    roots = [w.proc.pid for w in sb.workers()]
    c0, h0 = tree_cpu_s(roots), time.process_time()
    for _ in range(n):
        await run()
    return 1000 * (tree_cpu_s(roots) - c0 + time.process_time() - h0) / n


def sandbox_runner(sb: Any) -> Callable[[], Awaitable[bool]]:
    request = ExecRequest(code=TEST, wall_timeout_s=10)

    async def run() -> bool:
        r: ExecResult = await sb.run(request)
        return r.ok and r.stdout == "ok\n"

    return run


def subprocess_runner() -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", TEST,
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        return proc.returncode == 0 and out == b"ok\n"

    return run


def docker_run_runner(image: str) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        proc = await asyncio.create_subprocess_exec(
            "docker", "run", "--rm", "--network", "none", "--user", "65534:65534", "--read-only",
            "--cap-drop", "ALL", "--memory", "256m", image, "python3", "-I", "-S", "-c", TEST,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        return proc.returncode == 0 and out == b"ok\n"

    return run


def docker_up(image: str) -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=20).returncode == 0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput phase")
    ap.add_argument("--latency-n", type=int, default=200)
    ap.add_argument("--pool", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--image", default="agentrl/python:3.11")
    ap.add_argument("--no-docker", action="store_true")
    args = ap.parse_args()

    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    summary: dict[str, str] = {}
    print(f"load before: {os.getloadavg()}  cpus: {os.cpu_count()}")

    async with LocalSandbox(LocalConfig(pool_size=args.pool)) as sb:
        run = sandbox_runner(sb)
        await latency(run, 20)  # warm up
        p50, p95 = await latency(run, args.latency_n)
        per_s, failed = await throughput(run, args.seconds, args.callers)
        cpu_ms = await cpu_per_exec(sb, run, args.latency_n)
    cores = os.cpu_count() or 2
    print(f"local pool   : {per_s:8.1f}/s  p50 {p50:6.2f} ms  p95 {p95:6.2f} ms  failures {failed}")
    print(f"               {cpu_ms:.2f} CPU-ms per execution (all processes) -> at most "
          f"{1000 * cores / cpu_ms:.0f}/s on {cores} idle cores")
    summary.update(local_pool_per_s=f"{per_s:.0f}", p50_ms=f"{p50:.2f}", p95_ms=f"{p95:.2f}",
                   cpu_ms_per_exec=f"{cpu_ms:.2f}", idle_cores_bound_per_s=f"{1000 * cores / cpu_ms:.0f}")

    async with LocalSandbox(LocalConfig(mode="fresh", pool_size=args.pool)) as sb:
        run = sandbox_runner(sb)
        f50, _ = await latency(run, max(20, args.latency_n // 5))
        fresh_s, failed = await throughput(run, args.seconds, args.pool * 2)
    print(f"local fresh  : {fresh_s:8.1f}/s  p50 {f50:6.2f} ms  failures {failed}")
    summary.update(vs_fresh=f"{per_s / fresh_s:.1f}x", fresh_per_s=f"{fresh_s:.0f}", fresh_p50_ms=f"{f50:.1f}")

    run = subprocess_runner()
    s50, _ = await latency(run, max(20, args.latency_n // 5))
    sub_s, failed = await throughput(run, args.seconds, args.pool * 2)
    print(f"subprocess   : {sub_s:8.1f}/s  p50 {s50:6.2f} ms  failures {failed}  (no isolation)")
    summary.update(subprocess_per_s=f"{sub_s:.0f}", subprocess_p50_ms=f"{s50:.1f}")

    if not args.no_docker and docker_up(args.image):
        from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

        async with DockerSandbox(DockerConfig(image=args.image, pool_size=args.pool)) as dsb:
            run = sandbox_runner(dsb)
            d50, _ = await latency(run, 30)
            dock_s, failed = await throughput(run, args.seconds, args.pool * 2)
        print(f"docker exec  : {dock_s:8.1f}/s  p50 {d50:6.2f} ms  failures {failed}  (mode exec)")
        async with DockerSandbox(DockerConfig(image=args.image, pool_size=args.pool, mode="server")) as dsb:
            run = sandbox_runner(dsb)
            v50, _ = await latency(run, 100)
            serv_s, failed = await throughput(run, args.seconds, args.callers)
        print(f"docker server: {serv_s:8.1f}/s  p50 {v50:6.2f} ms  failures {failed}  (mode server)")
        run = docker_run_runner(args.image)
        r50, _ = await latency(run, 3)
        drun_s, failed = await throughput(run, args.seconds, args.pool)
        print(f"docker run   : {drun_s:8.1f}/s  p50 {r50:6.2f} ms  failures {failed}")
        summary.update(docker_pool_per_s=f"{dock_s:.1f}", docker_p50_ms=f"{d50:.0f}",
                       docker_server_per_s=f"{serv_s:.0f}", docker_server_p50_ms=f"{v50:.1f}",
                       docker_run_per_s=f"{drun_s:.2f}")
    else:
        summary.update(docker_pool_per_s="na", docker_run_per_s="na")
        print("docker       : skipped (no daemon or image)")

    summary["load1"] = f"{os.getloadavg()[0]:.2f}"
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    asyncio.run(main())
