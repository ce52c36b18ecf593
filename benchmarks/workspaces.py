"""Workspaces: start and exec latency, copy-on-write group start, leftovers, the bundled oracles.

Measured in one run, each against a baseline measured in the same run:

- local start p50 (a workspace ready for its first call) vs one fresh one-shot bwrap request;
- local exec p50 (`true` inside a live workspace) vs one request to the warm one-shot pool;
- docker start p50 (one container per workspace; skipped without a daemon);
- fork_vs_setup: a group of 8 workspaces started from one prepared state vs 8 workspaces that
  each run the set-up (a CPU-bound set-up of >= 2 s); both groups start concurrently, as a GRPO
  group does. The prepare itself (once per task) is reported apart and in fork_incl_prepare_vs_setup;
- leftovers: processes, temp dirs, mounts and cgroups after 64 concurrent local workspaces (each
  with a background process) close, plus containers after 16 concurrent docker workspaces;
- oracle_solved: the fraction of bundled terminal tasks whose solution passes its tests (local).

    flock /tmp/agentrl-heavy.lock python benchmarks/workspaces.py [--no-docker]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.sandboxes.base import ExecRequest
from agentrl.sandboxes.docker import setup_docker_host
from agentrl.sandboxes.local import LocalConfig, LocalSandbox
from agentrl.sandboxes.local_workspace import leftover_dirs
from agentrl.sandboxes.workspace import WorkspaceSpec

SETUP = ("python3 -c \"import time; t = time.process_time(); n = 0\nwhile time.process_time() - t < 2.0: n += 1\n"
         "open('/work/ready', 'w').write(str(n))\"")


def p50_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def p90_ms(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))] * 1000


def matching(marker: str) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                n += marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return n


def local_leftovers(marker: str) -> int:
    mounts = sum("agentrl-ws-" in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines())
    cgroups = sum(1 for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))
                  if root.exists() for _ in root.glob(f"**/agentrl-sbx-{os.getpid()}-ws*"))
    return matching(f"sleep {marker}") + len(leftover_dirs()) + mounts + cgroups


async def settle(marker: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while matching(f"sleep {marker}") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def local_part(n_start: int, n_exec: int, n_many: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with LocalSandbox(LocalConfig(pool_size=2)) as sb, LocalSandbox(LocalConfig(mode="fresh")) as fresh:
        starts, fresh_runs, execs, pool_runs = [], [], [], []
        for _ in range(n_start):
            t = time.perf_counter()
            ws = await sb.workspace(WorkspaceSpec(disk_mb=64)).start()
            starts.append(time.perf_counter() - t)
            await ws.close()
            t = time.perf_counter()
            await fresh.run(ExecRequest(argv=["true"]))
            fresh_runs.append(time.perf_counter() - t)
        async with sb.workspace(WorkspaceSpec(disk_mb=64)) as ws:
            for _ in range(n_exec):
                t = time.perf_counter()
                await ws.exec("true")
                execs.append(time.perf_counter() - t)
                t = time.perf_counter()
                await sb.run(ExecRequest(argv=["true"]))
                pool_runs.append(time.perf_counter() - t)
        out.update(local_start_p50_ms=p50_ms(starts), local_start_p90_ms=p90_ms(starts),
                   fresh_bwrap_request_p50_ms=p50_ms(fresh_runs),
                   local_exec_p50_ms=p50_ms(execs), local_exec_p90_ms=p90_ms(execs),
                   pool_request_p50_ms=p50_ms(pool_runs))

        spec = WorkspaceSpec(setup=(SETUP,), disk_mb=64)
        t = time.perf_counter()
        group = await asyncio.gather(*(sb.workspace(spec).start() for _ in range(8)))
        setup8 = time.perf_counter() - t
        assert all([(await w.exec("cat ready")).ok for w in group])
        await asyncio.gather(*(w.close() for w in group))
        t = time.perf_counter()
        prepared = await sb.prepare(spec)
        prepare_s = time.perf_counter() - t
        t = time.perf_counter()
        forks = await asyncio.gather(*(sb.workspace(spec, prepared=prepared).start() for _ in range(8)))
        fork8 = time.perf_counter() - t
        assert all([(await w.exec("cat ready")).ok for w in forks])
        await asyncio.gather(*(w.close() for w in forks))
        await prepared.close()
        out.update(setup8_s=setup8, prepare_s=prepare_s, fork8_s=fork8, fork_vs_setup=setup8 / fork8,
                   fork_incl_prepare_vs_setup=setup8 / (prepare_s + fork8))

        marker = f"{7000 + uuid.uuid4().int % 999}.{uuid.uuid4().int % 10**6}"

        async def one(i: int) -> bool:
            async with sb.workspace(WorkspaceSpec(disk_mb=16)) as w:
                await w.exec(f"sleep {marker} & echo {i} > n")
                return (await w.exec("cat n")).stdout == f"{i}\n"

        t = time.perf_counter()
        ok = await asyncio.gather(*(one(i) for i in range(n_many)))
        out["local_many_s"] = time.perf_counter() - t
        out["local_many_ok"] = sum(ok)
    await settle(marker)
    out["local_leftovers"] = local_leftovers(marker)
    return out


async def docker_part(n_start: int, n_many: int) -> dict[str, Any]:
    from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

    sb = DockerSandbox(DockerConfig(pool_size=1))
    out: dict[str, Any] = {}
    try:
        starts = []
        for _ in range(n_start):
            t = time.perf_counter()
            ws = await sb.workspace(WorkspaceSpec()).start()
            starts.append(time.perf_counter() - t)
            await ws.close()
        out["docker_start_p50_ms"] = p50_ms(starts[1:] or starts)  # the first also reaps and checks the image

        async def one(i: int) -> bool:
            async with sb.workspace(WorkspaceSpec()) as w:
                await w.exec("sleep 300 &")
                return (await w.exec(f"echo {i}")).stdout == f"{i}\n"

        t = time.perf_counter()
        out["docker_many_ok"] = sum(await asyncio.gather(*(one(i) for i in range(n_many))))
        out["docker_many_s"] = time.perf_counter() - t
        out["docker_leftovers"] = len(sb.client.containers.list(
            all=True, filters={"label": f"{sb.config.label}={sb.owner}"}))
    finally:
        await sb.close()
    return out


async def oracle_part() -> float:
    from agentrl.envs.harbor import load_tasks
    from agentrl.envs.terminal import TerminalEnv, run_oracle

    tasks = list(load_tasks(TerminalEnv().tasks_dir()))
    gate = asyncio.Semaphore(4)
    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        async def one(task: Any) -> float:
            async with gate, sb.workspace(task.local_spec(disk_mb=64)) as ws:
                return (await run_oracle(ws, task))[0]

        rewards = await asyncio.gather(*(one(t) for t in tasks))
    return sum(r == 1.0 for r in rewards) / len(tasks)


def docker_available() -> bool:
    setup_docker_host()
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        client.images.get("agentrl/python:3.11")
        return True
    except Exception:
        return False


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--many", type=int, default=64, help="concurrent local workspaces")
    ap.add_argument("--docker-many", type=int, default=16, help="concurrent docker workspaces")
    ap.add_argument("--no-docker", action="store_true")
    args = ap.parse_args()
    res: dict[str, Any] = {"load_avg_1m_at_start": os.getloadavg()[0]}  # a shared machine: read numbers with it
    res.update(await local_part(args.starts, args.execs, args.many))
    if not args.no_docker and docker_available():
        res.update(await docker_part(8, args.docker_many))
    res["oracle_solved"] = await oracle_part()
    for k, v in res.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    leftovers = res["local_leftovers"] + res.get("docker_leftovers", 0)
    docker_start = f"{res['docker_start_p50_ms']:.0f}" if "docker_start_p50_ms" in res else "skipped"
    print(f"local_start_p50_ms={res['local_start_p50_ms']:.1f} local_exec_p50_ms={res['local_exec_p50_ms']:.2f} "
          f"docker_start_p50_ms={docker_start} fork_vs_setup={res['fork_vs_setup']:.1f} leftovers={leftovers} "
          f"oracle_solved={res['oracle_solved']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
