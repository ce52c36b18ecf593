"""Finding the processes a test must kill from outside (from /proc: no psutil needed)."""

from __future__ import annotations

from pathlib import Path


def cmdline(pid: int) -> str:
    """The process's command line (its title, for Ray workers), '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def titled(pid: int, prefix: str) -> list[int]:
    """The processes below `pid` whose title starts with `prefix` (Ray actors: `ray::_Rank`, `ray::_Replica`)."""
    return [p for p in descendants(pid) if cmdline(p).startswith(prefix)]


def all_with(text: str) -> list[int]:
    """Every process whose command line contains `text`."""
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and text in cmdline(int(e.name))]
