"""Harbor task directories, read as they are (no `harbor` package: it needs Python >= 3.12).

A task is a directory::

    task.toml          version, [metadata], [agent] timeout_sec, [verifier] timeout_sec/env,
                       [environment] build_timeout_sec/cpus/memory_mb (or memory = "2G")/allow_internet
    instruction.md     the prompt
    environment/       Dockerfile (+ the files it COPYs)
    tests/test.sh      run as `bash /tests/test.sh` after the agent; writes /logs/verifier/reward.txt
                       (a number) or reward.json ({"reward": x})
    solution/solve.sh  the oracle (`bash /solution/solve.sh`), also a demonstration

The format follows Harbor's docs and `TaskConfig` (harbor.models.task.config);
keys we do not use are ignored, as Harbor ignores them. `[metadata] split`
(ours: "train"/"test") puts a task in one split; without it a task is in every split.

Where the environment runs:

- ``docker``: the Dockerfile is built on the local daemon (never pulled: its FROM
  must be a local image, e.g. ``agentrl/python:3.11``), tagged by a hash of the
  environment dir, and each episode is a container of that image.
- ``local`` (bubblewrap): a Dockerfile that is only a plain directory recipe runs
  without docker: FROM (the host's /usr stands in for the image), WORKDIR, ENV,
  COPY/ADD of files of environment/, RUN (as set-up commands, prepared once per
  task and forked copy-on-write); CMD, ENTRYPOINT, EXPOSE, LABEL, ARG, USER are
  ignored. Anything else is refused with a clear error: use docker for it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.sandboxes.workspace import WorkspaceSpec

TESTS_DIR, SOLUTION_DIR, LOGS_DIR = "/tests", "/solution", "/logs"
REWARD_TXT, REWARD_JSON = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"
DEFAULT_WORKDIR = "/app"
_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "ARG", "USER", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK",
            "SHELL", "VOLUME", "ONBUILD"}


class HarborFormatError(ValueError):
    """A task directory that is not a valid Harbor task (names the file and what is wrong)."""


@dataclass(slots=True)
class Recipe:
    """What a plain Dockerfile does, for running it without docker."""

    base: str
    workdir: str = DEFAULT_WORKDIR
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # absolute path -> content
    run: list[str] = field(default_factory=list)


@dataclass(slots=True)
class HarborTask:
    name: str
    path: Path
    instruction: str
    config: dict[str, Any]

    @property
    def split(self) -> str | None:
        value = self.config.get("metadata", {}).get("split")
        return str(value) if value is not None else None

    @property
    def agent_timeout_s(self) -> float:
        return float(self.config.get("agent", {}).get("timeout_sec", 600.0))

    @property
    def verifier_timeout_s(self) -> float:
        return float(self.config.get("verifier", {}).get("timeout_sec", 600.0))

    @property
    def verifier_env(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.config.get("verifier", {}).get("env", {}).items()}

    @property
    def memory_mb(self) -> int:
        env = self.config.get("environment", {})
        if "memory_mb" in env:
            return int(env["memory_mb"])
        if "memory" in env:
            return _size_mb(str(env["memory"]), f"{self.path}/task.toml environment.memory")
        return 2048

    @property
    def allow_internet(self) -> bool:
        return bool(self.config.get("environment", {}).get("allow_internet", False))

    def files_of(self, sub: str) -> dict[str, bytes]:
        """The files under ``sub`` (tests, solution), relative path -> content."""
        root = self.path / sub
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def env_hash(self) -> str:
        h = hashlib.sha256()
        for rel, data in sorted(self.files_of("environment").items()):
            h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()[:16]

    def image_tag(self) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.name.lower())
        return f"agentrl-harbor/{safe}:{self.env_hash()}"

    def recipe(self) -> Recipe:
        """The Dockerfile as a plain-directory recipe (local backend); HarborFormatError if it is more."""
        return parse_dockerfile(self.path / "environment" / "Dockerfile")

    def local_spec(self, *, disk_mb: int = 512) -> WorkspaceSpec:
        r = self.recipe()
        inside = (r.workdir, TESTS_DIR, SOLUTION_DIR, LOGS_DIR)
        extra = sorted({"/" + p.split("/")[1] for p in r.files
                        if not any(p.startswith(d + "/") for d in inside)})  # COPY outside the work dir
        return WorkspaceSpec(
            workdir=r.workdir, writable=(TESTS_DIR, SOLUTION_DIR, LOGS_DIR, *extra), files=dict(r.files), setup=tuple(r.run),
            env=r.env, memory_mb=self.memory_mb, disk_mb=disk_mb, network=self.allow_internet,
        )

    def docker_spec(self, image: str, workdir: str) -> WorkspaceSpec:
        return WorkspaceSpec(workdir=workdir, writable=(TESTS_DIR, SOLUTION_DIR, LOGS_DIR), image=image,
                             memory_mb=self.memory_mb, network=self.allow_internet)


def _size_mb(text: str, where: str) -> int:
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))
    except (KeyError, ValueError):
        raise HarborFormatError(f"{where}={text!r} is not a size (e.g. 2G, 512M)") from None


def load_task(path: Path) -> HarborTask:
    """One task directory; HarborFormatError naming what is missing or malformed."""
    toml_path, instr = path / "task.toml", path / "instruction.md"
    for need in (toml_path, instr, path / "tests" / "test.sh"):
        if not need.is_file():
            raise HarborFormatError(f"Harbor task {path}: {need.relative_to(path)} is missing")
    if not (path / "environment" / "Dockerfile").is_file():
        raise HarborFormatError(f"Harbor task {path}: environment/Dockerfile is missing "
                                "(docker-compose environments are not supported)")
    try:
        config = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise HarborFormatError(f"{toml_path}: {e}") from e
    return HarborTask(name=path.name, path=path, instruction=instr.read_text(), config=config)


def load_tasks(root: Path) -> list[HarborTask]:
    """Every task directory under ``root`` (sorted by name); a dir with task.toml is a task."""
    if not root.is_dir():
        raise HarborFormatError(f"tasks={str(root)!r}: no such directory")
    if (root / "task.toml").is_file():
        return [load_task(root)]
    tasks = [load_task(p.parent) for p in sorted(root.glob("*/task.toml"))]
    if not tasks:
        raise HarborFormatError(f"tasks={str(root)!r}: no task directories (each needs a task.toml)")
    return tasks


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, args) per Dockerfile instruction (line continuations joined, comments dropped)."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parse_dockerfile(path: Path) -> Recipe:
    """Read a plain Dockerfile into a :class:`Recipe` (see the module docstring for what is allowed)."""
    where = str(path)
    recipe: Recipe | None = None
    for word, args in _instructions(path.read_text()):
        if word == "FROM":
            if recipe is not None:
                raise HarborFormatError(f"{where}: multi-stage builds need the docker backend")
            recipe = Recipe(base=args.split()[0] if args else "")
            continue
        if recipe is None:
            if word == "ARG":
                continue
            raise HarborFormatError(f"{where}: {word} before FROM")
        if word == "WORKDIR":
            recipe.workdir = args if args.startswith("/") else f"{recipe.workdir}/{args}"
        elif word == "ENV":
            recipe.env.update(_env_pairs(args, where))
        elif word in ("COPY", "ADD"):
            _copy(recipe, args, path.parent, where)
        elif word == "RUN":
            recipe.run.append(_run_command(args))
        elif word not in _IGNORED:
            raise HarborFormatError(f"{where}: {word} is not supported without docker (allowed: FROM, WORKDIR, "
                                    "ENV, COPY, ADD, RUN); run this task with sandbox name docker")
    if recipe is None:
        raise HarborFormatError(f"{where}: no FROM")
    return recipe


def _run_command(args: str) -> str:
    if args.startswith("["):
        return shlex.join(json.loads(args))
    return args


def _env_pairs(args: str, where: str) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # legacy `ENV KEY value`
        return {parts[0]: " ".join(parts[1:])}
    pairs = {}
    for p in parts:
        key, sep, value = p.partition("=")
        if not sep:
            raise HarborFormatError(f"{where}: ENV {args!r} is not KEY=value")
        pairs[key] = value
    return pairs


def _copy(recipe: Recipe, args: str, context: Path, where: str) -> None:
    parts = json.loads(args) if args.startswith("[") else shlex.split(args)
    parts = [p for p in parts if not p.startswith("--")]
    if len(parts) < 2:
        raise HarborFormatError(f"{where}: COPY {args!r} needs a source and a destination")
    *sources, dest = parts
    if not dest.startswith("/"):
        dest = f"{recipe.workdir}/{dest}"
    for src in sources:
        base = (context / src).resolve()
        if not base.is_relative_to(context.resolve()) or not base.exists():
            raise HarborFormatError(f"{where}: COPY source {src!r} is not a file in the environment dir")
        if base.is_dir():
            for f in sorted(base.rglob("*")):
                if f.is_file():
                    recipe.files[f"{dest.rstrip('/')}/{f.relative_to(base)}"] = f.read_bytes()
        else:
            target = f"{dest.rstrip('/')}/{base.name}" if dest.endswith("/") or len(sources) > 1 else dest
            recipe.files[target] = base.read_bytes()


def parse_reward(txt: str | None, js: str | None) -> float | None:
    """The verifier's reward: reward.txt (a number) or reward.json ({"reward": x}, or its one number)."""
    if txt is not None and txt.strip():
        try:
            return float(txt.strip().split()[0])
        except ValueError:
            return None
    if js is not None:
        try:
            data = json.loads(js)
        except json.JSONDecodeError:
            return None
        if isinstance(data, int | float):
            return float(data)
        if isinstance(data, dict):
            if "reward" in data:
                return float(data["reward"])
            nums = [v for v in data.values() if isinstance(v, int | float)]
            if len(nums) == 1:
                return float(nums[0])
    return None
