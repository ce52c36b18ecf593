"""The built wheel installs into a fresh venv and ships agentrl.envs/.sandboxes/.trainers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("pyproject.toml", "README.md", "LICENSE", "agentrl", "envs", "sandboxes", "trainers")


def _copy_source(dest: Path) -> None:
    """What a clean clone holds (tracked + untracked-not-ignored files) of the shipped paths."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "--", *SHIPPED],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(ROOT)) for s in SHIPPED for p in ROOT.glob(f"{s}/**/*") if p.is_file()]
        listed += [s for s in SHIPPED if (ROOT / s).is_file()]
    for rel in listed:
        src = ROOT / rel
        if src.is_file() and "__pycache__" not in src.parts:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


PACKAGE_DIRS = {"agentrl": "agentrl", "envs": "agentrl/envs", "sandboxes": "agentrl/sandboxes", "trainers": "agentrl/trainers"}


def _assert_wheel_ships_every_source_file(src: Path, wheel: Path) -> None:
    """Every module and data file of the source tree is in the wheel (no forgotten subpackage)."""
    expected = set()
    for top, installed_as in PACKAGE_DIRS.items():
        for path in (src / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add(f"{installed_as}/{path.relative_to(src / top).as_posix()}")
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    missing = sorted(expected - shipped)
    assert not missing, (
        "files missing from the wheel (add the subpackage to [tool.setuptools] packages or the "
        f"data files to [tool.setuptools.package-data] in pyproject.toml): {missing}"
    )


def _run(cmd: list[str], cwd: Path) -> str:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_wheel_installs_and_imports_all_three_packages(tmp_path: Path) -> None:
    src, dist, venv, cwd = (tmp_path / d for d in ("src", "dist", "venv", "cwd"))
    for d in (src, cwd):
        d.mkdir()
    _copy_source(src)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check", "--outdir", str(dist), str(src)], cwd)
    (wheel,) = dist.glob("agentrl-*.whl")
    _assert_wheel_ships_every_source_file(src, wheel)

    # A fresh venv; its dependencies (pydantic, typer, ...) come from this environment's
    # site-packages through a .pth line (not processed as a site dir, so this
    # environment's editable agentrl stays invisible there).
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd)
    python = venv / "bin" / "python"
    venv_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd).strip())
    (venv_site / "_agentrl_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd)

    probe = (
        "import json, importlib.metadata as md\n"
        "import agentrl, agentrl.envs, agentrl.sandboxes, agentrl.trainers, agentrl.registry\n"
        "files = {m.__name__: m.__file__ for m in (agentrl, agentrl.envs, agentrl.sandboxes, agentrl.trainers)}\n"
        "groups = {g: sorted(e.name for e in md.entry_points(group='agentrl.' + g)) for g in ('envs', 'engines')}\n"
        "print(json.dumps({'files': files, 'groups': groups}))\n"
    )
    out = json.loads(_run([str(python), "-c", probe], cwd).strip().splitlines()[-1])
    for module, file in out["files"].items():
        assert Path(file).resolve().is_relative_to(venv.resolve()), f"{module} imported from {file}, not the wheel"
    assert "gymnasium" in out["groups"]["envs"]
    assert "scripted" in out["groups"]["engines"]
    help_text = _run([str(venv / "bin" / "agentrl"), "--help"], cwd)
    assert "check-env" in help_text


@pytest.mark.slow
def test_building_gives_setuptools_nothing_to_warn_about(tmp_path: Path) -> None:
    """Every shipped folder is a listed package and the license an SPDX string, so the builds that
    `pip install` and `scripts/setup.sh` run print no warning (a user reads warnings as errors)."""
    src = tmp_path / "src"
    src.mkdir()
    _copy_source(src)
    for hook in ("build_wheel", "build_editable"):
        out = tmp_path / hook
        out.mkdir()
        code = f"from setuptools import build_meta; build_meta.{hook}({str(out)!r})"
        # default warning filters, as pip's build hooks run: setuptools' own warnings show
        proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (proc.stdout + proc.stderr).splitlines()
        assert [line for line in lines if "Warning" in line] == [], hook
        assert list(out.glob("agentrl-*.whl")), hook
