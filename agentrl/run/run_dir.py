"""The on-disk layout of one training run, and its checkpoints.

```
runs/NAME/
  config.yaml            the fully resolved config the run started with
  trajectories.sqlite    every trajectory (TrajectoryStore)
  metrics.jsonl          one row per step (+ tensorboard/)
  checkpoints/step-000012/   trainer.save() output, written to a temp dir then renamed
  eval.json              results of `agentrl eval`
```
A checkpoint directory appears only complete: the trainer writes into
`checkpoints/.tmp-step-N` and the rename makes it visible atomically.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")


class RunDir:
    """Paths of a run plus checkpoint bookkeeping."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, output_dir: Path, name: str) -> RunDir:
        """A fresh run directory; a timestamp suffix avoids clobbering an old run."""
        path = output_dir / name
        if path.exists() and any(path.iterdir()):
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            path = output_dir / f"{name}-{stamp}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        return cls(path)

    @classmethod
    def existing(cls, path: Path) -> RunDir:
        if not (path / "config.yaml").exists():
            raise FileNotFoundError(f"{path} is not an agentrl run (no config.yaml)")
        return cls(path)

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def store_path(self) -> Path:
        return self.path / "trajectories.sqlite"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint as (step, path), or None."""
        found = []
        if self.checkpoints.exists():
            for child in self.checkpoints.iterdir():
                m = _STEP_DIR.match(child.name)
                if m and child.is_dir():
                    found.append((int(m.group(1)), child))
        return max(found) if found else None

    def save_checkpoint(self, step: int, write: Callable[[Path], None], *, keep: int = 2) -> Path:
        """Write a checkpoint atomically with `write(tmp_dir)`; keep the newest `keep`."""
        final = self.checkpoints / f"step-{step:06d}"
        tmp = self.checkpoints / f".tmp-step-{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        old = sorted(
            (int(m.group(1)), c) for c in self.checkpoints.iterdir() if (m := _STEP_DIR.match(c.name))
        )
        for _, stale in old[:-keep] if keep > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
        return final
