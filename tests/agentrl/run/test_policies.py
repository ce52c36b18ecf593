"""Several policies in one run: config, roles, per-policy views, staleness, metrics (agentrl.run.policies)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agentrl.config import resolve_config
from agentrl.errors import ConfigError
from agentrl.rollout.roster import Seat
from agentrl.run.policies import _merged, policy_groups, policy_lag, policy_view, roster, split_roles
from agentrl.types import Group, Message, Trajectory, Turn


def traj(turns: list[tuple[int, int, str | None]], *, reward: float = 1.0, agent: str | None = None,
         versions: int = 0, length: int = 12) -> Trajectory:
    """A trajectory of `length` tokens whose turns (start, end, policy) are sampled (mask 1)."""
    mask = [0] * length
    vers = [-1] * length
    logprobs = [0.0] * length
    for start, end, _ in turns:
        for i in range(start, end):
            mask[i], vers[i], logprobs[i] = 1, versions, -0.25
    return Trajectory(
        task_id="t", env="e", messages=[Message("user", "hi")], token_ids=list(range(length)), loss_mask=mask,
        logprobs=logprobs, versions=vers, turns=[Turn(s, e, reward=0.5, policy=p) for s, e, p in turns],
        reward=reward, group_id="g", info={"agent": agent} if agent else {},
    )


def test_a_policys_view_keeps_only_its_turns_as_sampled_tokens() -> None:
    t = traj([(2, 4, "alice"), (6, 8, "bob"), (9, 11, "alice")])
    view = policy_view(t, "alice")
    assert view is not None and view.id == t.id and view.token_ids == t.token_ids
    assert view.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0]
    assert [(x.start, x.end) for x in view.turns] == [(2, 4), (9, 11)]
    assert t.loss_mask[6:8] == [1, 1], "the original is left as it was"
    bob = policy_view(t, "bob")
    assert bob is not None and bob.loss_mask == [0] * 6 + [1, 1] + [0] * 4
    assert policy_view(t, "carol") is None
    alone = traj([(2, 4, "alice")])
    assert policy_view(alone, "alice") is alone, "a trajectory of one policy is its own view (no copy)"


def test_tokens_of_a_policy_give_its_spans_rewards_and_states() -> None:
    t = traj([(2, 4, "alice"), (6, 8, "bob")])
    sample = t.tokens("bob")
    assert sample.turn_spans == [(6, 8)] and sample.turn_rewards == [0.5]
    assert sample.turn_states == [t.turn_states()[1]]
    assert sum(sample.loss_mask) == 2 and t.policies == ["alice", "bob"]


def test_roles_split_a_group_and_leave_single_agent_groups_alone() -> None:
    plain = Group(task_id="t", trajectories=[traj([(2, 4, None)]), traj([(2, 4, None)])], id="a")
    game = Group(task_id="t", id="b", trajectories=[
        traj([(2, 4, "me")], agent="player_0", reward=1), traj([(2, 4, "me")], agent="player_1", reward=-1),
        traj([(2, 4, "me")], agent="player_0", reward=-1), traj([(2, 4, "me")], agent="player_1", reward=1),
    ])
    out = split_roles([plain, game])
    assert out[0] is plain
    assert [g.id for g in out[1:]] == ["b/player_0", "b/player_1"]
    assert [[t.info["agent"] for t in g.trajectories] for g in out[1:]] == [["player_0"] * 2, ["player_1"] * 2]
    assert split_roles(out) == out, "splitting is idempotent"


def test_policy_groups_hold_only_trajectories_the_policy_sampled() -> None:
    g = Group(task_id="t", id="g", trajectories=[traj([(2, 4, "alice")]), traj([(2, 4, "bob")])])
    assert [len(x.trajectories) for x in policy_groups([g], "alice")] == [1]
    assert policy_groups([g], "carol") == []


def test_staleness_counts_each_policy_against_its_own_version() -> None:
    g = Group(task_id="t", trajectories=[traj([(2, 4, "alice")], versions=3), traj([(2, 4, "bob")], versions=1)])
    assert policy_lag(g, {"alice": 3, "bob": 1}) == 0
    assert policy_lag(g, {"alice": 4, "bob": 1}) == 1
    assert policy_lag(g, {"alice": 3, "bob": 4}) == 3
    assert policy_lag(g, {"alice": 3}) == 0, "a policy that does not train never makes a group stale"


def test_metrics_are_per_policy_with_the_mean_under_the_plain_key() -> None:
    out = _merged({"alice": {"loss": 1.0, "trajectories": 4.0}, "bob": {"loss": 3.0}}, ["alice", "bob"])
    assert out["policy/alice/loss"] == 1.0 and out["policy/bob/loss"] == 3.0 and out["loss"] == 2.0
    assert out["policy/alice/trajectories"] == 4.0 and "trajectories" not in out
    assert out["policies/stepped"] == 2.0


def _config(**extra: Any) -> Any:
    raw: dict[str, Any] = {"env": "calculator", "trainer": {"lora": {"r": 4}}, **extra}
    return resolve_config(raw)


def test_the_config_maps_agents_to_policies_and_builds_the_roster() -> None:
    config = _config(
        policies={"alice": {"trainer": {"lr": 1e-4}}, "bob": {}, "bot": {"train": False, "opponent": "random"},
                  "base": {"train": False, "adapter": False}},
        agents={"player_0": "alice", "*": "bob"}, eval_agents={"*": "bot"},
    )
    r = roster(config)
    assert r.seat("player_0") == Seat(policy="alice", adapter="alice")
    assert r.seat("player_7") == Seat(policy="bob", adapter="bob")
    assert roster(config, evaluation=True).seat("player_1") == Seat(policy="bot", opponent="random")
    assert roster(config, evaluation=True).seat("player_0").policy == "alice"
    assert resolve_config({"env": "calculator", "policies": {"base": {"train": False, "adapter": False}, "me": {}},
                           "trainer": {"lora": {"r": 4}}, "agents": {"*": "base"}}).policies["base"].adapter is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"agents": {"a": "alice"}}, "no policies: section"),
        ({"policies": {"alice": {}}, "agents": {"a": "carol"}}, "agents.a: policy 'carol' is not one of"),
        ({"policies": {"alice": {}}}, "agents: a run with policies"),
        ({"policies": {"alice": {"train": False}}, "agents": {"a": "alice"}}, "none of ['alice'] trains"),
        ({"policies": {"bot": {"opponent": "random"}, "me": {}}, "agents": {"*": "me"}}, "set train: false"),
        ({"policies": {"alice": {"trainer": {"lr": -1}}}, "agents": {"*": "alice"}}, "policies.alice.trainer.lr"),
        ({"policies": {"bad name": {}}, "agents": {"*": "bad name"}}, "policies"),
    ],
)
def test_a_bad_policies_section_names_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(**extra)


def test_a_trained_policy_needs_lora() -> None:
    with pytest.raises(ConfigError, match=re.escape("policies.alice.trainer.lora")):
        resolve_config({"env": "calculator", "policies": {"alice": {}}, "agents": {"*": "alice"}})


def _agent_run(gateway: dict[str, Any], agents: dict[str, str]) -> Any:
    return resolve_config({
        "env": {"name": "agent", "agent": "my_pkg.agent:solve", "tasks": [{"prompt": "hi"}], "gateway": gateway},
        "trainer": {"lora": {"r": 4}}, "agents": agents,
        "policies": {"planner": {}, "worker": {}, "base": {"train": False, "adapter": False}},
    })


def test_a_gateway_env_routes_models_to_the_runs_policies() -> None:
    gateway = _agent_run({}, {"agent": "worker"}).env.config.gateway
    assert gateway.model_policies == {"planner": "planner", "worker": "worker"}  # base has no adapter to serve
    assert gateway.default_policy == "worker" and gateway.policy_of("gpt-4o") == "worker"
    assert gateway.policy_of("planner") == "planner"
    own = _agent_run({"model_policies": {"big": "planner"}}, {"*": "planner"}).env.config.gateway
    assert own.model_policies == {"big": "planner"} and own.default_policy == "planner"
    with pytest.raises(ConfigError, match=re.escape("env.gateway.model_policies.big: policy 'base' is not one")):
        _agent_run({"model_policies": {"big": "base"}}, {"*": "worker"})
    with pytest.raises(ConfigError, match=re.escape("env.gateway.default_policy: policy 'nobody'")):
        _agent_run({"default_policy": "nobody"}, {"*": "worker"})
