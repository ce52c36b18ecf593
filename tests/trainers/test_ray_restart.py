"""`run.max_restarts`: `agentrl train` gets past a trainer rank killed mid-run by restarting itself.

A real failure, from outside: the process of one `ray` trainer rank is sent
SIGKILL while the run trains. The run must restart from its last checkpoint
(new trainer group, new engine), finish every step, and store every trained
group exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from process_tree import titled

from agentrl.store.trajectory_store import TrajectoryStore

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.distributed]


def test_a_killed_rank_is_restarted_from_the_last_checkpoint(tmp_path: Path, ray_train_cmd: Any) -> None:
    cmd = ray_train_cmd(
        tmp_path, "run.steps=4", "run.save_every=1", "run.max_restarts=1", "rollout.group_size=2",
        "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=8", "rollout.max_turns=2",
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = tmp_path / "ci"
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) as proc:
        try:
            deadline = time.monotonic() + 600
            while not (run / "checkpoints" / "step-000001").exists():
                assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
                assert time.monotonic() < deadline, "no checkpoint at step 1"
                time.sleep(0.2)
            ranks = titled(proc.pid, "ray::_Rank")  # the rank actors of this run
            assert len(ranks) == 2, f"expected the 2 rank actors below the run, found {ranks}"
            os.kill(ranks[1], signal.SIGKILL)
            _out, err = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1/1" in err and "died" in err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "grad_norm" in r]
    assert rl[-1]["step"] == 4 and {1, 2, 3, 4} <= {r["step"] for r in rl}
    assert rl[-1]["run/restarts"] == 1.0 and "run/restarts" not in rl[0]
    assert (run / "checkpoints" / "step-000004" / "model").is_dir()
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r for r in store.iter_records() if r.status == "trained"]
        steps = sorted(r.step for r in trained)
    assert steps == sorted([1, 2, 3, 4] * 2 * 2)  # every step's groups, each stored once
