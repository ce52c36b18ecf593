"""Build the default sandbox image locally; nothing is ever pulled.

Two ways, chosen by ``method``:

- ``dockerfile``: ``docker build`` of a small Dockerfile ``FROM python:3.11-slim``
  (only where a registry is reachable).
- ``debootstrap``: a Debian ``minbase`` root filesystem with ``python3``,
  made by ``debootstrap`` from the Debian mirror (a package registry, reachable
  where container registries are not), then ``docker import``.

``auto`` uses debootstrap when it is installed, else the Dockerfile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

DEFAULT_IMAGE = "agentrl/python:3.11"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_ENV_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

DOCKERFILE = f"""\
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8
RUN mkdir -p /work && chmod 1777 /work
USER 65534:65534
WORKDIR /work
LABEL org.agentrl.sandbox=1
CMD ["sleep", "infinity"]
# built by agentrl sandbox build-image (tag {DEFAULT_IMAGE})
"""


def _docker_cli() -> str:
    cli = shutil.which("docker")
    if cli is None:
        raise RuntimeError("the `docker` command line tool is needed to build images (apt-get install docker.io)")
    return cli


def image_exists(tag: str = DEFAULT_IMAGE) -> bool:
    """Whether the local daemon already has ``tag`` (never contacts a registry)."""
    cli = _docker_cli()
    return subprocess.run([cli, "image", "inspect", tag], capture_output=True).returncode == 0


def build_image(
    tag: str = DEFAULT_IMAGE,
    *,
    method: Literal["auto", "dockerfile", "debootstrap"] = "auto",
    suite: str = "bookworm",
    mirror: str = DEFAULT_MIRROR,
    packages: tuple[str, ...] = ("python3",),
    rootfs: Path | None = None,
    force: bool = False,
) -> str:
    """Build ``tag`` and return it. Skips the work when the image exists (unless ``force``).

    ``rootfs`` keeps the debootstrap tree there (reused when it already holds
    one) instead of a temporary directory.
    """
    if not force and image_exists(tag):
        return tag
    if method == "auto":
        method = "debootstrap" if shutil.which("debootstrap") else "dockerfile"
    if method == "dockerfile":
        with tempfile.TemporaryDirectory() as ctx:
            Path(ctx, "Dockerfile").write_text(DOCKERFILE)
            subprocess.run([_docker_cli(), "build", "-t", tag, ctx], check=True)
        return tag
    if shutil.which("debootstrap") is None:
        raise RuntimeError("method debootstrap needs `debootstrap` (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise RuntimeError("debootstrap must run as root")
    tmp = None
    if rootfs is None:
        tmp = tempfile.mkdtemp(prefix="agentrl-rootfs-")
        rootfs = Path(tmp)
    try:
        if not (rootfs / "usr" / "bin" / "python3").exists():
            subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs), mirror],
                check=True,
            )
        (rootfs / "work").mkdir(exist_ok=True)
        (rootfs / "work").chmod(0o1777)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / cache).glob("*.deb"):
                p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        changes = [_ENV_PATH, "ENV LANG=C.UTF-8", "WORKDIR /work", 'CMD ["sleep", "infinity"]',
                   "LABEL org.agentrl.sandbox=1"]
        argv = [_docker_cli(), "import"]
        for c in changes:
            argv += ["--change", c if c.startswith(("ENV", "WORKDIR", "CMD", "LABEL")) else f"ENV {c}"]
        imp = subprocess.run([*argv, "-", tag], stdin=tar.stdout, capture_output=True, text=True)
        if tar.stdout is not None:
            tar.stdout.close()
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imp.stderr.strip()}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tag
