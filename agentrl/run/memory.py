"""Process memory per step, measured like time: `memory/*` metrics of the run.

`MemoryProbe.metrics()` gives, for the process that trains:

- `memory/rss_mb`: resident set size now (after the step and the allocator trim);
- `memory/peak_rss_mb`: the process's high-water mark so far (VmHWM; the same
  number `/usr/bin/time -v` reports as "Maximum resident set size" at the end);
- `memory/trimmed_mb`: what `malloc_trim` handed back to the OS after the step;
- `memory/engine/<key>` and `memory/trainer/<key>`: the parts' own shares
  (e.g. the hf engine's KV and prefix cache, the trainer's weights and
  optimizer state), from their optional `memory_stats()` (MB by name).

Why trim: glibc keeps freed heap pages of a thread's arena for reuse, and a
step frees hundreds of MB of activations, KV and logits chunks in several
threads (trainer thread, engine worker); without a trim the RSS shows the
largest allocation pattern seen so far in every arena, not what is live.

Reads /proc/self/status (Linux) and falls back to `resource.getrusage`, so it
imports no torch (the core stays torch-free, tests/agentrl/test_no_torch.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

StatusReader = Callable[[], str]


def _proc_status() -> str:
    return Path("/proc/self/status").read_text()


def process_memory_mb(read_status: StatusReader = _proc_status) -> tuple[float, float]:
    """(RSS now, peak RSS) of this process in MiB.

    /proc/self/status `VmRSS` / `VmHWM` where there is one; otherwise the peak
    from `getrusage` (KiB on Linux, bytes on macOS) for both.
    """
    try:
        fields = dict(line.split(":", 1) for line in read_status().splitlines() if ":" in line)
        rss = _kib(fields["VmRSS"]) / 1024
        peak = _kib(fields["VmHWM"]) / 1024
        return rss, max(peak, rss)
    except (OSError, KeyError, ValueError):
        maxrss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        peak = maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024
        return peak, peak


def _kib(field: str) -> float:
    value, unit = field.split()
    if unit.lower() != "kb":
        raise ValueError(f"unexpected /proc/self/status unit {unit!r}")
    return float(value)


@runtime_checkable
class MemoryReporting(Protocol):
    """A run part (engine, trainer) that reports its own share of the memory, in MiB per named item."""

    def memory_stats(self) -> dict[str, float]: ...


class AllocatorTrim:
    """`malloc_trim(0)` of glibc: hand freed heap pages of every arena back to the OS.

    A no-op (`available` False) where libc has no malloc_trim (musl, macOS).
    """

    def __init__(self) -> None:
        self._trim: Callable[[int], int] | None = None
        name = ctypes.util.find_library("c") or "libc.so.6"
        try:
            self._trim = ctypes.CDLL(name).malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def __call__(self) -> None:
        if self._trim is not None:
            self._trim(0)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def bound_heap_retention(threshold_mb: float = 1.0) -> bool:
    """Serve every allocation of `threshold_mb` or more with its own mmap, returned to the OS on free.

    glibc's default threshold starts at 128 KiB but rises to the size of each
    freed mapping (up to 32 MiB), so after the first step activations, KV and
    logits chunks of a few MiB land in per-thread heap arenas that keep them
    after free: RSS then follows the largest pattern ever seen in each of the
    trainer's and the engine's threads. A fixed threshold also turns that
    rise off. True when set; False where libc has no `mallopt` (musl, macOS)
    or `MALLOC_MMAP_THRESHOLD_` in the environment already decides.
    """
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)))


class MemoryProbe:
    """The run's `memory/*` metrics (module docstring); one per run, no global state.

    `parts` maps a share's name ("engine", "trainer") to the object whose
    optional `memory_stats() -> {key: MB}` reports it; objects without one add nothing.
    """

    def __init__(
        self,
        parts: Mapping[str, object] | None = None,
        *,
        trim: bool = True,
        read_status: StatusReader = _proc_status,
    ) -> None:
        self._parts = dict(parts or {})
        self._trim = AllocatorTrim() if trim else None
        self._read_status = read_status

    def metrics(self) -> dict[str, float]:
        """Trim the allocator (when on), then measure: see the module docstring for the keys."""
        out: dict[str, float] = {}
        if self._trim is not None and self._trim.available:
            before, _ = process_memory_mb(self._read_status)
            self._trim()
            after, _ = process_memory_mb(self._read_status)
            out["memory/trimmed_mb"] = max(0.0, before - after)
        rss, peak = process_memory_mb(self._read_status)
        out["memory/rss_mb"] = rss
        out["memory/peak_rss_mb"] = peak
        for share, part in self._parts.items():
            if not isinstance(part, MemoryReporting):
                continue
            for key, value in part.memory_stats().items():
                out[f"memory/{share}/{key}"] = float(value)
        return out
