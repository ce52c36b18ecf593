"""Run config: YAML, overrides, plugin sections validated by the plugin's Config, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from agentrl.config import (
    RunConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_override,
    resolve_config,
)
from agentrl.env import Env, EnvConfig, StepResult
from agentrl.errors import ConfigError
from agentrl.registry import Plugins
from agentrl.types import Message

TORCH_TRAINER = "agentrl.trainers.torch_trainer:TorchTrainer"  # a lazy string: never imported here


class EchoEnv(Env):
    """Echoes the reply."""

    class Config(EnvConfig):
        mode: Literal["upper", "lower"] = "upper"
        max_len: int = Field(100, ge=1)

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        return [{"id": "0"}]

    async def reset(self, task, *, seed=None):  # type: ignore[no-untyped-def]
        return [Message(role="user", content="hi")], {}

    async def step(self, action: Message) -> StepResult:
        return StepResult(messages=[], terminated=True)


class FakeEngine:
    """An engine with its own config."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        replies: list[str] = Field(default_factory=lambda: ["ok"])
        latency_s: float = Field(0.0, ge=0.0)


@pytest.fixture
def plugins() -> Plugins:
    p = Plugins()
    p.envs.add("echo", EchoEnv, source="test")
    p.engines.add("fake", FakeEngine, source="test")
    p.trainers.add("torch", TORCH_TRAINER, source="test")
    return p


BASE: dict[str, Any] = {"env": {"name": "echo"}, "engine": {"name": "fake"}}


def resolve(plugins: Plugins, raw: dict[str, Any], *overrides: str) -> RunConfig:
    return resolve_config(raw, list(overrides), plugins=plugins)


def error_of(plugins: Plugins, raw: dict[str, Any], *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(plugins, raw, *overrides)
    return str(e.value)


def test_defaults_are_filled_in_everywhere(plugins: Plugins) -> None:
    config = resolve(plugins, BASE)
    assert config.run.output_dir == "runs"
    assert config.model.path == "smollm2-135m-instruct"
    assert config.rollout.max_staleness == 1
    assert config.env.params == {"mode": "upper", "max_len": 100}
    assert isinstance(config.env.config, EchoEnv.Config)
    assert config.engine.params == {"replies": ["ok"], "latency_s": 0.0}
    assert config.trainer.name == "torch"
    assert config.trainer.params["advantage"] == "grpo"  # TrainerConfig defaults
    assert config.registry() is plugins


def test_keys_that_would_do_nothing_are_errors(plugins: Plugins) -> None:
    """No silent no-ops: a run-level sandbox or reward, or an engine model other than the policy."""
    msg = error_of(plugins, {**BASE, "sandbox": {"name": "docker"}})
    assert msg.startswith("sandbox: not a run-level section;") and "env.sandbox" in msg
    assert error_of(plugins, {**BASE, "reward": "math"}).startswith("reward: not a run-level section;")
    plugins.engines.add("model_engine", ModelEngine, source="test")
    raw = {"env": "echo", "engine": {"name": "model_engine", "model": "other/model"}}
    assert error_of(plugins, raw, "model.path=/m") == (
        "engine.model: got 'other/model', but the engine serves the policy the trainer trains, "
        "model.path='/m'; set model.path instead"
    )
    config = resolve(plugins, raw, "model.path=other/model")  # the same model, said twice, is fine
    assert config.engine.params["model"] == "other/model"


def test_trainer_temperature_follows_the_sampling_temperature(plugins: Plugins) -> None:
    """Set once (rollout.sampling.temperature); a trainer.temperature that differs is an error when the
    config loads (config show/explain too), not after the model is loaded."""
    derived = resolve(plugins, BASE, "rollout.sampling.temperature=0.7")
    assert derived.trainer.params["temperature"] == 0.7
    assert derived.trainer.config.temperature == 0.7  # type: ignore[union-attr]  # what the trainer is built with
    msg = error_of(plugins, BASE, "rollout.sampling.temperature=0.7", "trainer.temperature=1.0")
    assert msg.startswith("trainer.temperature: got 1.0, but the trainer must score tokens under the distribution")
    assert msg.endswith("rollout.sampling.temperature=0.7; set rollout.sampling.temperature instead")
    both = resolve(plugins, BASE, "rollout.sampling.temperature=0.7", "trainer.temperature=0.7")
    assert both.trainer.params["temperature"] == 0.7  # the same value, said twice, is fine


def test_a_greedy_rollout_temperature_is_refused_naming_the_rollout_key(plugins: Plugins) -> None:
    """Temperature 0 is refused up front under the key the user set (rollout.sampling.temperature),
    saying what is allowed and why, not as an error about trainer.temperature; greedy evaluation
    (run.eval_temperature: 0) stays allowed."""
    msg = error_of(plugins, BASE, "rollout.sampling.temperature=0")
    assert msg.startswith("rollout.sampling.temperature: got 0.0"), msg
    assert "greater than 0" in msg and "logprobs" in msg and "run.eval_temperature" in msg
    assert not msg.startswith("trainer.")
    greedy_eval = resolve(plugins, BASE, "run.eval_temperature=0")
    assert greedy_eval.run.eval_temperature == 0.0


def test_one_seed_for_the_run(plugins: Plugins) -> None:
    """run.seed seeds the trainer and the engine too; a plugin seed that differs is an error."""
    plugins.engines.add("seeded", SeededEngine, source="test")
    config = resolve(plugins, {**BASE, "engine": "seeded"}, "run.seed=7")
    assert config.trainer.params["seed"] == 7 and config.engine.params["seed"] == 7
    assert error_of(plugins, BASE, "run.seed=7", "trainer.seed=3") == (
        "trainer.seed: got 3, but a run has one seed, run.seed=7; set run.seed instead"
    )
    msg = error_of(plugins, {**BASE, "engine": {"name": "seeded", "seed": 1}})
    assert msg == "engine.seed: got 1, but a run has one seed, run.seed=0; set run.seed instead"


def test_derived_params_are_not_dumped_and_follow_their_run_key(plugins: Plugins, tmp_path: Path) -> None:
    """A resolved config.yaml re-derives them, so an override of the run key applies on reload."""
    config = resolve(plugins, BASE, "rollout.sampling.temperature=0.7", "run.seed=3")
    data = yaml.safe_load(dump_config(config))
    assert "temperature" not in data["trainer"] and "seed" not in data["trainer"]
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    again = load_config(path, ["rollout.sampling.temperature=0.5"], plugins=plugins)
    assert again.trainer.params["temperature"] == 0.5 and again.trainer.params["seed"] == 3


def test_a_gpu_engine_beside_a_trainer_left_on_the_cpu_is_an_error(plugins: Plugins) -> None:
    """The torch trainer's device defaults to cpu: with the engine on a GPU that is almost never meant."""
    from agentrl.engines.hf import HFEngine

    plugins.engines.add("hf", HFEngine, source="test")  # its Config only
    gpu = {"env": {"name": "echo"}, "engine": {"name": "hf", "device": "cuda:1"}}
    msg = error_of(plugins, gpu)
    assert msg.startswith("engine.device=cuda:1 but trainer.device is not set") and "trainer.device: cuda:1" in msg
    assert resolve(plugins, gpu, "trainer.device=cpu").trainer.params["device"] == "cpu"  # said explicitly: fine
    assert resolve(plugins, {"env": {"name": "echo"}, "engine": {"name": "hf", "device": "cpu"}}).engine.name == "hf"


def test_engine_context_must_hold_an_episode(plugins: Plugins) -> None:
    """vLLM's max_model_len below the episode token budget would fail episodes mid-run: caught at load."""
    from agentrl.engines.vllm_engine import VLLMEngine

    plugins.engines.add("vllm", VLLMEngine, source="test")  # its Config only: vLLM itself is not imported
    raw = {**BASE, "engine": {"name": "vllm", "max_model_len": 1024}}
    msg = error_of(plugins, raw, "rollout.max_total_tokens=4096")
    assert msg.startswith("engine.max_model_len=1024 is below rollout.max_total_tokens=4096:")
    fits = resolve(plugins, raw, "rollout.max_total_tokens=1024")
    assert fits.engine.params["max_model_len"] == 1024


def test_ray_pool_replica_engine_is_checked_at_load(plugins: Plugins) -> None:
    """A misspelt replica engine or option fails when the config loads, not when Ray starts the replicas."""
    from agentrl.engines.ray_pool import RayEnginePool

    plugins.engines.add("ray", RayEnginePool, source="test")  # its Config only: Ray itself is not imported
    msg = error_of(plugins, {**BASE, "engine": {"name": "ray", "replica": {"name": "fak"}}})
    assert msg == (
        "engine.replica: got {'name': 'fak'}; name: unknown engine 'fak'; did you mean 'fake'? (available: fake, ray)"
    )
    msg = error_of(plugins, {**BASE, "engine": {"name": "ray", "replica": {"name": "ray"}}})
    assert "a ray replica cannot itself be a ray pool" in msg
    ok = resolve(plugins, {**BASE, "engine": {"name": "ray", "replicas": 3, "replica": {"name": "fake"}}})
    assert ok.engine.params["replicas"] == 3


def test_trainer_sections_that_would_be_ignored_are_errors(plugins: Plugins) -> None:
    msg = error_of(plugins, {**BASE, "trainer": {"name": "torch", "advantage": "grpo", "critic": {}}})
    assert "trainer.critic is only used by trainer.advantage='gae' (got 'grpo')" in msg
    gae = resolve(plugins, {**BASE, "trainer": {"name": "torch", "advantage": "gae", "critic": {}}})
    assert gae.trainer.params["critic"] is not None


def test_configs_written_by_earlier_versions_still_load(plugins: Plugins) -> None:
    """Their run's config.yaml held `sandbox: null`, `reward: null`, `rollout.reward_timeout_s: 60.0`."""
    old = {**BASE, "sandbox": None, "reward": None, "rollout": {"reward_timeout_s": 60.0, "group_size": 4}}
    assert resolve(plugins, old).rollout.group_size == 4
    assert "rollout.reward_timeout_s: unknown key" in error_of(plugins, BASE, "rollout.reward_timeout_s=5")


def test_overrides_parse_yaml_scalars_and_nest(plugins: Plugins) -> None:
    config = resolve(
        plugins,
        BASE,
        "rollout.group_size=4",
        "run.name=my run",
        "rollout.sampling.stop_strings=[a, b]",
        "env.mode=lower",
        "trainer.kl.coef=0.05",
        "rollout.dynamic_sampling=true",
    )
    assert config.rollout.group_size == 4
    assert config.run.name == "my run"
    assert config.rollout.sampling.stop_strings == ["a", "b"]
    assert config.env.params["mode"] == "lower"
    assert config.trainer.params["kl"]["coef"] == 0.05
    assert config.rollout.dynamic_sampling is True


def test_override_helpers() -> None:
    assert parse_override("a.b.c=3") == (["a", "b", "c"], 3)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2.5", "d.e=null"]) == {"a": {"b": 1, "c": 2.5}, "d": {"e": None}}
    with pytest.raises(ConfigError, match=r"not of the form key\.path=value"):
        parse_override("rollout.group_size")
    with pytest.raises(ConfigError, match=r"run\.steps\.x: cannot set it, run\.steps is 5, not a section"):
        apply_overrides({"run": {"steps": 5}}, ["run.steps.x=1"])


# ---------------------------------------------------------------- bad configs


def test_bad_negative_staleness_names_key_value_and_bound(plugins: Plugins) -> None:
    msg = error_of(plugins, BASE, "rollout.max_staleness=-1")
    assert msg == "rollout.max_staleness: got -1; Input should be greater than or equal to 0"


def test_bad_enum_in_trainer_lists_choices(plugins: Plugins) -> None:
    msg = error_of(plugins, {**BASE, "trainer": {"name": "torch", "advantage": "ppo"}})
    assert msg.startswith("trainer.advantage: got 'ppo';")
    for choice in ("'grpo'", "'dr_grpo'", "'rloo'", "'reinforce_pp'", "'gae'"):
        assert choice in msg


def test_bad_env_param_is_checked_by_the_env_config(plugins: Plugins) -> None:
    msg = error_of(plugins, {"env": {"name": "echo", "mode": "shout"}, "engine": {"name": "fake"}})
    assert msg == "env.mode: got 'shout'; Input should be 'upper' or 'lower'"


def test_misspelt_key_suggests_the_right_one(plugins: Plugins) -> None:
    msg = error_of(plugins, BASE, "rollout.max_stalenes=2")
    assert msg == "rollout.max_stalenes: unknown key; did you mean 'max_staleness'?"
    msg = error_of(plugins, {**BASE, "engine": {"name": "fake", "latency": 1}})
    assert msg == "engine.latency: unknown key; did you mean 'latency_s'?"
    msg = error_of(plugins, {**BASE, "runn": {}})
    assert msg == "runn: unknown key; did you mean 'run'?"


def test_unknown_plugin_name_lists_available(plugins: Plugins) -> None:
    msg = error_of(plugins, {"env": {"name": "ecoh"}})
    assert msg == "env.name: unknown env 'ecoh'; did you mean 'echo'? (available: echo)"
    msg = error_of(plugins, {**BASE, "trainer": {"name": "deepspeed"}})
    assert msg.startswith("trainer.name: unknown trainer 'deepspeed'") and "torch" in msg


def test_missing_env_and_several_problems_on_one_line(plugins: Plugins) -> None:
    assert error_of(plugins, {}) == "env: required key is missing"
    msg = error_of(plugins, {**BASE, "run": {"steps": 0, "loggers": ["wandb2"]}})
    assert msg.startswith("2 problems: ")
    assert "run.steps: got 0; Input should be greater than or equal to 1" in msg
    assert "run.loggers.0: got 'wandb2'" in msg and "'tensorboard'" in msg
    assert "\n" not in msg


def test_bad_pattern_and_cross_field_rule(plugins: Plugins) -> None:
    msg = error_of(plugins, BASE, "rollout.tool_output_truncation=top")
    assert msg.startswith("rollout.tool_output_truncation: got 'top';") and "left|right|middle" in msg
    msg = error_of(plugins, BASE, "trainer.schedule=cosine")
    assert "trainer.schedule='cosine' needs trainer.total_steps" in msg


def test_yaml_file_errors(tmp_path: Path, plugins: Plugins) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", plugins=plugins)
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {name: echo\nrun: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad, plugins=plugins)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections, got list"):
        load_config(listy, plugins=plugins)


# ---------------------------------------------------------------- files, plugin modules, round trip


def test_load_imports_plugin_modules_next_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "cfg_neighbour_plugins.py").write_text(
        "import agentrl\n"
        "from agentrl.env import Env, EnvConfig\n\n"
        "@agentrl.env('neighbour')\n"
        "class Neighbour(Env):\n"
        "    '''Lives next to the config.'''\n"
        "    class Config(EnvConfig):\n"
        "        level: int = 1\n"
        "    def tasks(self, split='train'):\n"
        "        return []\n"
        "    async def reset(self, task, *, seed=None):\n"
        "        return [], {}\n"
        "    async def step(self, action):\n"
        "        raise NotImplementedError\n\n"
        "@agentrl.plugin('engines', 'neighbour_engine')\n"
        "class Engine:\n"
        "    '''No config.'''\n"
    )
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "plugins": ["cfg_neighbour_plugins"],
                "env": {"name": "neighbour", "level": 3},
                "engine": {"name": "neighbour_engine"},
                "trainer": {"name": TORCH_TRAINER, "lr": 1e-5},
            }
        )
    )
    config = load_config(path, ["rollout.group_size=2"])
    assert config.env.params == {"level": 3}
    assert config.trainer.params["lr"] == 1e-5
    assert config.rollout.group_size == 2
    assert "neighbour" in config.registry().envs


def test_dump_round_trips_exactly(tmp_path: Path, plugins: Plugins) -> None:
    config = resolve(plugins, BASE, "trainer.kl.coef=0.1", "env.mode=lower", "rollout.on_error.format=drop_group")
    text = dump_config(config)
    data = yaml.safe_load(text)
    assert data["env"] == {"name": "echo", "mode": "lower", "max_len": 100}
    assert data["rollout"]["on_error"]["format"] == "drop_group"
    assert data["trainer"]["betas"] == [0.9, 0.999]
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    again = load_config(path, plugins=plugins)
    assert dump_config(again) == text
    assert again.model_dump() == config.model_dump()


class SeededEngine:
    """An engine with a sampler seed like `hf` has."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        seed: int = 0


class ModelEngine:
    """An engine that takes the policy model like `hf` does."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: str = "default-model"
        dtype: Literal["auto", "bf16", "fp32"] = "auto"


def test_engine_model_and_dtype_follow_the_model_section(plugins: Plugins) -> None:
    plugins.engines.add("model_engine", ModelEngine, source="test")
    raw = {"env": {"name": "echo"}, "engine": {"name": "model_engine"}, "model": {"path": "/models/x", "dtype": "bf16"}}
    config = resolve(plugins, raw)
    assert config.engine.params == {"model": "/models/x", "dtype": "bf16"}
    config = resolve(plugins, raw, "engine.dtype=fp32")  # explicit engine params win
    assert config.engine.params == {"model": "/models/x", "dtype": "fp32"}
    assert "model" not in resolve(plugins, BASE).engine.params  # engines without the field get nothing


def test_warm_start_section(plugins: Plugins) -> None:
    assert resolve(plugins, BASE).warm_start.steps == 0
    msg = error_of(plugins, BASE, "warm_start.steps=5", "warm_start.source=store")
    assert "warm_start.source='store' needs warm_start.store_path" in msg
    msg = error_of(plugins, BASE, "warm_start.source=dataset")
    assert msg.startswith("warm_start.source: got 'dataset';") and "'demonstrations' or 'store'" in msg


def test_plugin_section_shorthand(plugins: Plugins) -> None:
    config = resolve(plugins, {"env": "echo", "engine": "fake"})
    assert config.env.params == {"mode": "upper", "max_len": 100}
    assert resolve(plugins, BASE, "env=echo").env.name == "echo"
    assert error_of(plugins, {"env": 3}).startswith("env: got 3;")


def test_misspelt_key_inside_an_optional_nested_section(plugins: Plugins) -> None:
    msg = error_of(plugins, BASE, "trainer.critic.lrr=0.1")
    assert msg == "trainer.critic.lrr: unknown key; did you mean 'lr'?"


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")))
def test_every_example_config_loads_and_lists_its_tasks(name: str) -> None:
    """The shipped examples validate with the installed plugins, and their env has train tasks."""
    from agentrl.config import load_config

    path = Path(__file__).resolve().parents[2] / "examples" / name
    config = load_config(path)
    assert config.run.name == path.stem
    env = config.registry().create_env(config.env.name, config.env.params)
    assert next(iter(env.tasks("train")), None) is not None


def test_a_removed_run_key_is_an_error_naming_it(plugins: Plugins) -> None:
    message = error_of(plugins, {**BASE, "run": {"gc_threshold": 10_000}})
    assert "run.gc_threshold=10000: this key was removed" in message and "delete it" in message
