"""Re-execute a stored trajectory against its env and say whether it reproduces.

The env is created by name with the run config's params (through `Plugins`),
reset with the stored task and seed, then stepped with each stored assistant
message in turn (so the same tool calls, with the same call ids). After each
step the env's messages are compared with the stored messages that followed
that assistant turn, and the step reward with the stored turn reward; at the
end the summed env reward with the stored reward. Nothing is written anywhere.

This mirrors `run_episode`: the reward is the sum of the step rewards, each
turn keeps the reward of the step that answered it, and the rollout keeps
neither the messages of the final step nor those that no longer fitted the
token budget (so a last turn without stored messages is not compared). A tool
output the rollout cut to `max_tool_output_tokens` matches when the stored
head and tail around the truncation marker match the replayed output.
A rollout may put messages before the env's opening ones (a tools system
prompt, demonstrations), so the reset check only asks that the stored opening
*ends with* what `reset` returned.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.env import Env
from agentrl.types import JSON, Message, Trajectory


@dataclass(slots=True)
class StepCheck:
    """One comparison: the reset, or the step after model turn `turn`."""

    turn: int | None
    ok: bool
    messages_ok: bool
    stored: list[dict[str, JSON]]
    replayed: list[dict[str, JSON]]
    reward_stored: float | None = None
    reward_replayed: float | None = None
    note: str = ""


@dataclass(slots=True)
class CheckReport:
    """Whether observations and reward reproduce, with every comparison made."""

    trajectory_id: str
    env: str
    ok: bool = False
    observations_ok: bool = False
    reward_ok: bool = False
    reward_stored: float | None = None
    reward_replayed: float | None = None
    terminated_stored: bool | None = None
    terminated_replayed: bool | None = None
    steps: list[StepCheck] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, JSON]:
        d = asdict(self)
        for key in ("reward_stored", "reward_replayed"):
            d[key] = _finite(d[key])
        for s in d["steps"]:
            s["reward_stored"] = _finite(s["reward_stored"])
            s["reward_replayed"] = _finite(s["reward_replayed"])
        return d


def env_params(run_config: Mapping[str, Any] | None, env_name: str) -> dict[str, Any]:
    """The env params of the run config, if its env is the trajectory's env."""
    section = (run_config or {}).get("env")
    if isinstance(section, dict) and section.get("name") == env_name:
        return {k: v for k, v in section.items() if k != "name"}
    return {}


def default_env_factory(run_config: Mapping[str, Any] | None) -> Callable[[str], Env]:
    """Create envs through the plugins the run used (entry points + `plugins` modules)."""
    from agentrl.config import on_path
    from agentrl.registry import Plugins

    modules = (run_config or {}).get("plugins") or []
    with on_path(Path.cwd()):  # user plugin modules import from the working directory, as in `train`
        plugins = Plugins.discover(modules=list(modules))
    return lambda name: plugins.create_env(name, env_params(run_config, name))


async def recheck(
    traj: Trajectory,
    make_env: Callable[[str], Env],
    *,
    timeout_s: float = 60.0,
    reward_tol: float = 1e-6,
) -> CheckReport:
    """Replay `traj` on a fresh env from `make_env(traj.env)`; never raises for env failures."""
    report = CheckReport(
        trajectory_id=traj.id,
        env=traj.env,
        reward_stored=traj.reward,
        terminated_stored=traj.terminated,
    )
    env: Env | None = None
    try:
        env = make_env(traj.env)
        opening, replies = _split(traj.messages)
        async with asyncio.timeout(timeout_s):
            obs, _info = await env.reset(dict(traj.task), seed=traj.seed)
        want = opening[len(opening) - len(obs) :] if len(obs) <= len(opening) else opening
        same = _same(want, obs)
        report.steps.append(
            StepCheck(
                turn=None, ok=same, messages_ok=same, stored=_dicts(want), replayed=_dicts(obs), note="reset"
            )
        )
        total = 0.0
        terminated = False
        for k, (action, stored_obs) in enumerate(replies):
            if terminated:
                report.steps.append(StepCheck(turn=k, ok=False, messages_ok=False, stored=_dicts(stored_obs),
                                              replayed=[], note="the env had already terminated"))  # fmt: skip
                break
            async with asyncio.timeout(timeout_s):
                result = await env.step(action)
            total += result.reward
            terminated = result.terminated or result.truncated
            stored_reward = traj.turns[k].reward if k < len(traj.turns) else None
            last = k == len(replies) - 1
            obs_ok = True if last and not stored_obs else _same(stored_obs, result.messages)
            reward_ok = stored_reward is None or _close(stored_reward, result.reward, reward_tol)
            report.steps.append(
                StepCheck(
                    turn=k,
                    ok=obs_ok and reward_ok,
                    messages_ok=obs_ok,
                    stored=_dicts(stored_obs),
                    replayed=_dicts(result.messages),
                    reward_stored=stored_reward,
                    reward_replayed=result.reward,
                    note=("" if obs_ok else "observations differ") + ("" if reward_ok else " reward differs"),
                )
            )
        report.reward_replayed = total
        report.terminated_replayed = terminated
        report.observations_ok = all(s.messages_ok for s in report.steps)
        report.reward_ok = _close(traj.reward, total, reward_tol) and all(
            s.ok or not s.messages_ok for s in report.steps
        )
        report.ok = report.observations_ok and report.reward_ok
    except TimeoutError:
        report.error = f"the env did not answer within {timeout_s:g} s"
    except Exception as e:
        report.error = f"{type(e).__name__}: {e}"
    finally:
        if env is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await env.close()
            except Exception as e:
                report.error = report.error or f"env.close failed: {type(e).__name__}: {e}"
    return report


def _split(messages: Sequence[Message]) -> tuple[list[Message], list[tuple[Message, list[Message]]]]:
    """Opening messages, then (assistant message, the messages after it) per model turn."""
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    replies: list[tuple[Message, list[Message]]] = []
    for m in messages[first:]:
        if m.role == "assistant":
            replies.append((m, []))
        else:
            replies[-1][1].append(m)
    return list(messages[:first]), replies


def _dicts(messages: Sequence[Message]) -> list[dict[str, JSON]]:
    return [m.to_dict() for m in messages]


_MARKER = re.compile(r"\n\.\.\.\[\d+ tokens truncated\]\.\.\.\n")


def _same(stored: Sequence[Message], replayed: Sequence[Message]) -> bool:
    if len(stored) != len(replayed):
        return False
    return all(_same_message(s, r) for s, r in zip(stored, replayed, strict=True))


def _same_message(stored: Message, replayed: Message) -> bool:
    a, b = stored.to_dict(), replayed.to_dict()
    if a == b:
        return True
    parts = _MARKER.split(stored.content)
    if stored.role != "tool" or len(parts) != 2 or {**a, "content": ""} != {**b, "content": ""}:
        return False
    head, tail = parts[0].rstrip("\ufffd"), parts[1].lstrip("\ufffd")  # a cut may split a character
    return replayed.content.startswith(head) and replayed.content.endswith(tail)


def _close(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _finite(x: Any) -> float | None:
    return x if isinstance(x, int | float) and math.isfinite(x) else None
