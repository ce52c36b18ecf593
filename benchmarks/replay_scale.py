"""How fast the replay UI lists trajectories in a 100k-trajectory store.

Builds a store of N synthetic multi-turn tool-calling trajectories (default
100k, ~600 tokens each: compact token blobs + message JSON, as a run writes
them), serves it with the real replay server, and times through the HTTP API:

- first page: what the list view requests on load (page 1 + the match count,
  in parallel, like the app);
- filtered page: the same for several typical filters (env + reward range,
  tool used, error class, step range, length range, full-text search); the
  summary reports the slowest of them;
- a deep page (the 1000th) by cursor.

Baseline in the same run: the naive design, one unindexed table holding each
trajectory as a JSON document (as if a JSONL dump were loaded into SQLite),
filtered with json_extract / LIKE and paginated with OFFSET.

    python benchmarks/replay_scale.py [--n 100000] [--path DIR] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.replay.server import ReplaySettings, create_app
from agentrl.replay.synthetic import synthetic_group
from agentrl.store.trajectory_store import STORE_FILENAME, TrajectoryStore

FILTERS = {
    "env+reward": "env=python_sandbox&reward_min=1",
    "tool": "tool=lookup",
    "error": "error=timeout",
    "steps": "step_min={mid}&step_max={mid_end}",
    "length": "length_min=900&length_max=1000",
    "search": "search=ZeroDivisionError",
    "search+env": "search=Traceback&env=python_sandbox&truncated=false",
}
NAIVE = {  # the same filters on the unindexed JSON table
    "first": "1",
    "env+reward": "json_extract(doc,'$.env')='python_sandbox' AND json_extract(doc,'$.reward')>=1",
    "tool": 'doc LIKE \'%"name":"lookup"%\'',
    "error": "json_extract(doc,'$.error.kind')='timeout'",
    "steps": "step BETWEEN {mid} AND {mid_end}",
    "length": "json_array_length(doc,'$.token_ids') BETWEEN 900 AND 1000",
    "search": "doc LIKE '%ZeroDivisionError%'",
    "search+env": "doc LIKE '%Traceback%' AND json_extract(doc,'$.env')='python_sandbox' "
    "AND json_extract(doc,'$.truncated')=0",
}


def build(path: Path, n: int, group_size: int = 8, words: int = 24) -> float:
    """Write n trajectories (groups of 8, 64 per step) like a training run would."""
    started = time.perf_counter()
    tok = SimpleChatTokenizer()
    rng = random.Random(0)
    groups_per_step = 8
    with TrajectoryStore(path, commit_every=256) as store:
        store.set_run_config({"run": {"name": "replay-scale"}, "env": {"name": "calculator"}})
        index = 0
        while index * group_size < n:
            step = index // groups_per_step + 1
            group = synthetic_group(rng, step=step, index=index, group_size=group_size, tokenizer=tok,
                                    words=words, token_stats=False)  # fmt: skip
            store.add_group(group, step=step, status="trained")
            index += 1
            if index % groups_per_step == 0:
                store.add_metrics(step, {"reward/mean": statistics.fmean(group.rewards)})
            if index % 1000 == 0:
                print(
                    f"  {index * group_size} trajectories, {time.perf_counter() - started:.0f}s", flush=True
                )
    return time.perf_counter() - started


def build_naive(store_path: Path, path: Path) -> None:
    """The baseline: every trajectory as one JSON document, no index but the rowid."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE naive (seq INTEGER PRIMARY KEY, step INTEGER, doc TEXT)")
    with TrajectoryStore(store_path, readonly=True) as store:
        batch = []
        for r in store.iter_records(batch_size=1000):
            d = r.trajectory.to_dict()
            batch.append((r.seq, r.step, json.dumps(d, separators=(",", ":"))))
            if len(batch) == 2000:
                db.executemany("INSERT INTO naive VALUES (?, ?, ?)", batch)
                batch = []
        db.executemany("INSERT INTO naive VALUES (?, ?, ?)", batch)
    db.commit()
    db.close()


async def timed_get(session: aiohttp.ClientSession, url: str) -> tuple[float, object]:
    started = time.perf_counter()
    async with session.get(url) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    return (time.perf_counter() - started) * 1000, body


async def ui_load(session: aiohttp.ClientSession, base: str, query: str) -> tuple[float, int, int]:
    """Page 1 + count in parallel, as the list view does; returns (ms, rows, matches)."""
    started = time.perf_counter()
    (_, page), (_, count) = await asyncio.gather(
        timed_get(session, f"{base}/api/trajectories?limit=50&{query}"),
        timed_get(session, f"{base}/api/count?{query}"),
    )
    ms = (time.perf_counter() - started) * 1000
    return ms, len(page["items"]), count["count"]  # type: ignore[index]


def _fill(template: str, n: int) -> str:
    mid = n // 64 // 2  # the middle step of the run (64 trajectories per step)
    return template.format(mid=mid, mid_end=mid + 20)


async def measure(path: Path, repeats: int, n: int) -> dict[str, float]:
    app = create_app(ReplaySettings(path))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    out: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as session:
            cold, rows, total = await ui_load(session, base, "")
            print(f"first page (cold): {cold:.1f} ms, {rows} rows of {total}")
            out["first_cold"] = cold
            for name, query in {"first": "", **FILTERS}.items():
                query = _fill(query, n)
                times = []
                for _ in range(repeats):
                    ms, rows, matches = await ui_load(session, base, query)
                    times.append(ms)
                out[name] = statistics.median(times)
                print(
                    f"{name:>11}: median {out[name]:7.1f} ms  max {max(times):7.1f} ms  ({matches} matches)"
                )
            cursor = ""
            started = time.perf_counter()
            pages = min(1000, n // 50 - 1)
            for _ in range(pages):
                _, page = await timed_get(session, f"{base}/api/trajectories?limit=50&cursor={cursor}")
                cursor = page["next_cursor"]  # type: ignore[index]
            deep_started = time.perf_counter()
            await timed_get(session, f"{base}/api/trajectories?limit=50&cursor={cursor}")
            out["deep"] = (time.perf_counter() - deep_started) * 1000
            out["walk_s"] = deep_started - started
            print(
                f"page {pages + 1} by cursor: {out['deep']:.1f} ms (walking {pages} pages: {out['walk_s']:.1f}s)"
            )
    finally:
        await runner.cleanup()
    return out


def measure_naive(path: Path, repeats: int, n: int) -> dict[str, float]:
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    out: dict[str, float] = {}
    for name, template in NAIVE.items():
        where = _fill(template, n)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            rows = db.execute(
                f"SELECT seq, doc FROM naive WHERE {where} ORDER BY seq DESC LIMIT 50"
            ).fetchall()
            count = db.execute(f"SELECT count(*) FROM naive WHERE {where}").fetchone()[0]
            times.append((time.perf_counter() - started) * 1000)
        out[name] = statistics.median(times)
        print(f"{name:>11}: median {out[name]:7.1f} ms  ({count} matches, {len(rows)} rows)")
    started = time.perf_counter()
    pages = min(1000, n // 50 - 1)
    db.execute("SELECT seq, doc FROM naive ORDER BY seq DESC LIMIT 50 OFFSET ?", (pages * 50,)).fetchall()
    out["deep"] = (time.perf_counter() - started) * 1000
    print(f"page {pages + 1} by OFFSET: {out['deep']:.1f} ms")
    db.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000, help="trajectories in the store")
    parser.add_argument("--path", type=Path, help="reuse/keep the store in this directory")
    parser.add_argument("--keep", action="store_true", help="do not delete the store afterwards")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    workdir = args.path or Path(tempfile.mkdtemp(prefix="replay-scale-"))
    db = workdir / STORE_FILENAME
    try:
        if not db.exists():
            print(f"building {args.n} trajectories in {db} ...", flush=True)
            build_s = build(db, args.n)
            print(f"built in {build_s:.0f}s ({args.n / build_s:.0f} trajectories/s)")
        with TrajectoryStore(db, readonly=True) as store:
            n = store.count()
        naive_db = workdir / "naive.sqlite"
        if not naive_db.exists():
            build_naive(db, naive_db)
        size_mb = db.stat().st_size / 1e6
        print(f"store: {n} trajectories, {size_mb:.0f} MB; load {os.getloadavg()[0]:.2f}")
        print("agentrl store through the HTTP API (page of 50 + count):")
        ours = asyncio.run(measure(db, args.repeats, n))
        print("baseline: unindexed JSON documents + OFFSET, queried directly (no HTTP):")
        naive = measure_naive(naive_db, max(1, args.repeats // 2), n)
        filtered = max(ours[k] for k in FILTERS)
        naive_filtered = max(naive[k] for k in FILTERS)
        print(
            f"n={n} first_page_ms={ours['first']:.1f} first_page_cold_ms={ours['first_cold']:.1f} "
            f"filtered_ms={filtered:.1f} deep_page_ms={ours['deep']:.1f} "
            f"baseline_first_page_ms={naive['first']:.1f} baseline_filtered_ms={naive_filtered:.1f} "
            f"baseline_deep_page_ms={naive['deep']:.1f}"
        )
    finally:
        if not args.keep and args.path is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
