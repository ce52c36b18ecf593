"""The run's `memory/*` metrics: parsing, fallbacks, the parts' own shares, and a real allocation."""

from __future__ import annotations

import sys

import pytest

from agentrl.run.memory import AllocatorTrim, MemoryProbe, process_memory_mb

STATUS = "Name:\tpython\nVmHWM:\t  2048000 kB\nVmRSS:\t  1024000 kB\nThreads:\t3\n"


def test_reads_rss_and_peak_from_proc_status() -> None:
    assert process_memory_mb(lambda: STATUS) == (1000.0, 2000.0)


def test_falls_back_to_getrusage_without_proc() -> None:
    def missing() -> str:
        raise FileNotFoundError("/proc/self/status")

    rss, peak = process_memory_mb(missing)
    assert rss == peak > 10  # a Python process holds more than 10 MB


def test_probe_reports_each_parts_own_share_under_its_name() -> None:
    class Engine:
        def memory_stats(self) -> dict[str, float]:
            return {"kv_cache_mb": 12.5, "prefix_cache_mb": 3}

    probe = MemoryProbe({"engine": Engine(), "trainer": object()}, trim=False, read_status=lambda: STATUS)
    assert probe.metrics() == {
        "memory/rss_mb": 1000.0,
        "memory/peak_rss_mb": 2000.0,
        "memory/engine/kv_cache_mb": 12.5,
        "memory/engine/prefix_cache_mb": 3.0,
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_rss_follows_a_real_allocation_and_peak_keeps_it() -> None:
    probe = MemoryProbe()
    before = probe.metrics()
    block = b"\x01" * (256 * 2**20)  # written, so resident
    during = probe.metrics()
    del block
    after = probe.metrics()
    assert during["memory/rss_mb"] - before["memory/rss_mb"] > 200
    assert during["memory/peak_rss_mb"] >= during["memory/rss_mb"]
    # the kernel folds per-thread RSS counters into the high-water mark lazily: a few MB of slack
    assert after["memory/rss_mb"] < during["memory/rss_mb"] - 200  # freed (a large block is its own mapping)
    assert after["memory/peak_rss_mb"] >= during["memory/rss_mb"] - 8
    assert after["memory/trimmed_mb"] >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_trim_returns_freed_small_blocks_to_the_os() -> None:
    trim = AllocatorTrim()
    assert trim.available
    keep = [bytes(200) for _ in range(5)]
    garbage = [bytearray(b"\x01" * 1000) for _ in range(200_000)]  # ~200 MB of small heap blocks
    tail = bytearray(b"\x01" * 1000)  # allocated last: the heap cannot shrink from its top by itself
    del garbage
    rss_before, _ = process_memory_mb()
    trim()
    rss_after, _ = process_memory_mb()
    assert rss_before - rss_after > 100, (rss_before, rss_after)
    del keep, tail


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_bounded_heap_retention_returns_freed_blocks_without_a_trim() -> None:
    import os
    import subprocess

    # in a fresh process: the threshold is process-wide
    code = (
        "from agentrl.run.memory import bound_heap_retention, process_memory_mb\n"
        "import sys\n"
        "assert bound_heap_retention(1.0) is (sys.argv[1] == 'on')\n"
        "blocks, keep = [], []\n"
        "for _ in range(64):\n"  # 256 MB in 4 MB blocks, each with a live block above it in the heap
        "    blocks.append(bytearray(b'\\x01') * (4 << 20))\n"
        "    keep.append(bytearray(b'\\x01') * 200_000)\n"
        "del blocks\n"
        "print(process_memory_mb()[0])\n"
    )
    env_off = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}  # the environment decides: the call leaves it

    on = float(subprocess.run([sys.executable, "-c", code, "on"], capture_output=True, text=True, check=True,
                              env={k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}).stdout)
    off = float(subprocess.run([sys.executable, "-c", code, "off"], capture_output=True, text=True, check=True,
                               env={**os.environ, **env_off}).stdout)
    assert off - on > 150, (on, off)  # kept in the heap without the bound, handed back with it
