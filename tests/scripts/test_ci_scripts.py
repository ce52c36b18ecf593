"""The CI scripts agree with each other: scripts/test.sh sources the services file setup writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _assignments(script: str) -> dict[str, str]:
    """`NAME=value` lines of a shell script, each value expanded with the names before it."""
    names: dict[str, str] = {}
    for line in script.splitlines():
        found = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)=(\S+)\s*(#.*)?$", line)
        if found and "$(" not in found.group(2):
            names[found.group(1)] = _expand(shlex.split(found.group(2))[0], names)
    return names


def _expand(text: str, names: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: names.get(m.group(1), m.group(0)), text)


def _sourced(script: str) -> list[str]:
    """The files a shell script sources (`. FILE` / `source FILE`), names expanded."""
    names = _assignments(script)
    out = []
    for found in re.finditer(r"(?:^|;)[ \t]*(?:\.|source)[ \t]+(\"[^\"]+\"|\S+)", script, re.M):
        target = _expand(shlex.split(found.group(1))[0], names)
        if target != ".venv/bin/activate":
            out.append(target)
    return out


def test_test_sh_sources_the_services_file_setup_sandboxes_writes() -> None:
    setup = (ROOT / ".ci" / "setup_sandboxes.sh").read_text()
    written = _assignments(setup)["ENV_FILE"]
    assert written == "/run/agentrl/docker.env"  # what tests/sandboxes/conftest.py reads too
    assert re.search(r'>\s*"\$ENV_FILE"', setup), "setup_sandboxes.sh no longer writes $ENV_FILE"
    sourced = _sourced((ROOT / "scripts" / "test.sh").read_text())
    assert sourced == [written], f"scripts/test.sh sources {sourced}; .ci/setup_sandboxes.sh writes {written}"
