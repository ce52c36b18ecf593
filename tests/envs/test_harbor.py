"""Harbor task directories: the format, plain Dockerfiles on local, images built on docker, `harbor` env."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs.harbor import HarborFormatError, load_task, load_tasks, parse_dockerfile, parse_reward
from agentrl.envs.terminal import HarborConfig, HarborEnv, TerminalConfig, run_oracle, run_tests
from agentrl.sandboxes.docker import setup_docker_host
from agentrl.types import Message, ToolCall


def docker_skip_reason() -> str | None:
    """Why docker cases skip here (no SDK, no daemon answering, no sandbox image), or None."""
    setup_docker_host()
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        client.images.get("agentrl/python:3.11")
        client.close()
    except Exception as e:
        return f"no docker daemon with agentrl/python:3.11 ({type(e).__name__}); run .ci/setup_sandboxes.sh"
    return None


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def make_task(root: Path, name: str = "json-reward", dockerfile: str | None = None) -> Path:
    """A task as a user would write it: reward.json, a COPY, a RUN, ENV, metadata without a split."""
    d = root / name
    (d / "environment" / "seed").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 30.0\n'
                                 'env = { EXPECTED = "42" }\n[agent]\ntimeout_sec = 60.0\n'
                                 '[environment]\nmemory = "1G"\n')
    (d / "instruction.md").write_text("Write the answer into /srv/answer.txt.\n")
    (d / "environment" / "seed" / "question.txt").write_text("6 * 7\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile or (
        "# a comment\nFROM agentrl/python:3.11\nWORKDIR /srv\nENV GREETING=hi OTHER=x\n"
        "COPY seed/ /srv/\nRUN echo \"$GREETING\" > made.txt && \\\n    cp question.txt q2.txt\nCMD [\"bash\"]\n"))
    (d / "tests" / "test.sh").write_text(
        '#!/bin/bash\nmkdir -p /logs/verifier\n'
        'if [ "$(cat /srv/answer.txt)" = "$EXPECTED" ] && [ "$(cat /srv/made.txt)" = hi ]; then\n'
        '  echo \'{"reward": 1.0, "detail": 3}\' > /logs/verifier/reward.json\n'
        'else\n  echo \'{"reward": 0.0}\' > /logs/verifier/reward.json\nfi\n')
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho $(( $(cat /srv/q2.txt) )) > /srv/answer.txt\n")
    return d


def test_format(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path))
    assert (task.memory_mb, task.verifier_timeout_s, task.verifier_env, task.split) == (1024, 30.0, {"EXPECTED": "42"},
                                                                                        None)
    r = task.recipe()
    assert (r.base, r.workdir, r.env) == ("agentrl/python:3.11", "/srv", {"GREETING": "hi", "OTHER": "x"})
    assert r.files == {"/srv/question.txt": b"6 * 7\n"}
    assert r.run == ['echo "$GREETING" > made.txt &&  cp question.txt q2.txt']
    assert task.local_spec().workdir == "/srv"
    assert [t.name for t in load_tasks(tmp_path)] == ["json-reward"]
    assert parse_reward("0.5\n", None) == 0.5
    assert parse_reward(None, '{"reward": 1}') == 1.0 and parse_reward(None, '{"score": 0.25}') == 0.25
    assert parse_reward(None, None) is None and parse_reward("nan?", None) is None


def test_bad_tasks_say_what_is_wrong(tmp_path: Path) -> None:
    d = make_task(tmp_path)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(HarborFormatError, match=r"tests/test\.sh is missing"):
        load_task(d)
    d2 = make_task(tmp_path, "multi", "FROM a AS b\nRUN x\nFROM c\n")
    with pytest.raises(HarborFormatError, match="multi-stage builds need the docker backend"):
        parse_dockerfile(d2 / "environment" / "Dockerfile")
    d3 = make_task(tmp_path, "healthy", "FROM x\nVOLUME /data\nONBUILD RUN x\nSTOPSIGNAL 9\nFOO bar\n")
    with pytest.raises(HarborFormatError, match=r"FOO is not supported without docker.*sandbox name docker"):
        parse_dockerfile(d3 / "environment" / "Dockerfile")
    with pytest.raises(HarborFormatError, match="no such directory"):
        load_tasks(tmp_path / "nope")
    with pytest.raises(ValueError, match="tasks"):
        HarborConfig.model_validate({})


@needs_bwrap
async def test_own_task_dir_runs_on_local_through_the_harbor_env(tmp_path: Path) -> None:
    make_task(tmp_path)
    env = HarborEnv(HarborConfig(tasks=str(tmp_path)))
    try:
        tasks = list(env.tasks("test"))
        assert tasks == [{"id": "json-reward", "split": "test"}] and list(env.tasks("train"))  # no split: in both
        messages, _ = await env.reset(tasks[0])
        assert "/srv" in messages[0].content and messages[1].content.startswith("Write the answer")
        call = ToolCall(id="a", name="bash", arguments={"command": "cat q2.txt made.txt; echo 42 > answer.txt"})
        r = await env.step(Message(role="assistant", content="", tool_calls=[call]))
        assert r.messages[0].content == "6 * 7\nhi\n[exit code 0]"
        r = await env.step(Message(role="assistant", content="", tool_calls=[ToolCall(id="b", name="submit",
                                                                                       arguments={})]))
        assert r.terminated and r.reward == 1.0
    finally:
        await env.close()


@pytest.mark.docker
async def test_docker_builds_the_tasks_image_and_the_oracle_passes(tmp_path: Path) -> None:
    docker_reason = docker_skip_reason()
    if docker_reason:
        pytest.skip(docker_reason)
    from agentrl.envs.terminal import TaskStates
    from agentrl.sandboxes.docker import DockerConfig, DockerSandbox

    task = load_task(make_task(tmp_path, dockerfile=(
        "FROM agentrl/python:3.11\nWORKDIR /srv\nENV GREETING=hi\nCOPY seed/ /srv/\n"
        "RUN echo \"$GREETING\" > made.txt && cp question.txt q2.txt\nHEALTHCHECK NONE\n")))
    sb: Any = DockerSandbox(DockerConfig(pool_size=1))
    states = TaskStates()
    try:
        spec, prepared = await states.get(task, sb, TerminalConfig(sandbox={"name": "docker"}))
        assert prepared is None and spec.image == task.image_tag() and spec.workdir == "/srv"
        async with sb.workspace(spec) as ws:
            assert (await run_tests(ws, task))[0] == 0.0
        async with sb.workspace(spec) as ws:
            reward, info = await run_oracle(ws, task)
            assert reward == 1.0, info
    finally:
        await states.close()
        import contextlib

        with contextlib.suppress(Exception):
            sb.client.images.remove(task.image_tag(), force=True)
        await sb.close()
