"""The run config: one pydantic model from YAML plus `a.b=c` command-line overrides.

Fixed sections (`run`, `model`, `rollout`, `warm_start`) are typed here; plugin
sections (`env`, `engine`, `trainer`) are `{name: ..., <params>}` and their
params are validated by the plugin's own `Config` (found through a `Plugins`
registry), so every key is either honoured or rejected: a key that would do
nothing is an error too (a run-level `sandbox`). A bad config raises
`ConfigError` with the full key path, the bad value and what is allowed::

    rollout.max_staleness: got -1; Input should be greater than or equal to 0

A value that several parts must share is set once and derived for the rest
(`DERIVED`: the engine serves `model.path`, the trainer scores at
`rollout.sampling.temperature`, everything seeds from `run.seed`); a plugin
param that says otherwise is an error naming the key to set instead.

`dump_config` writes the fully resolved config (every default filled in, the
derived params left out) as YAML; loading that YAML again gives the same config.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo

from agentrl.errors import ConfigError, PluginError, config_error
from agentrl.registry import Plugins
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.roster import SINGLE_AGENT, Roster
from agentrl.run.alerts import AlertsSection

Logger = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    """Where the run lives, how long it trains, when it saves and evaluates."""

    name: str = Field(
        "run",
        description="run directory under output_dir (a timestamp is added if it exists and is not empty)",
    )
    output_dir: str = Field("runs", description="directory that holds the run directories")
    seed: int = Field(
        0,
        description="the run's one seed: the training task order, every episode's sampling, "
        "the trainer's RNGs (trainer.seed) and the engine's default sampler seed (engine.seed)",
    )
    steps: int = Field(100, ge=1, description="optimizer steps to train")
    save_every: int = Field(50, ge=1, description="checkpoint every N steps (and at the end)")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps; 0 = never")
    eval_tasks: int = Field(64, ge=1, description="tasks of the eval split per evaluation")
    eval_split: str = Field("test", description="env task split to evaluate on (training uses split train)")
    eval_samples: int = Field(1, ge=1, description="samples per eval task (pass@k uses k <= this)")
    eval_temperature: float | None = Field(
        None, ge=0.0,
        description="sampling temperature of evaluations (0 = greedy); null = rollout.sampling.temperature",
    )  # fmt: skip
    loggers: list[Logger] = Field(  # pydantic copies mutable defaults per instance
        ["jsonl"],
        description="metric sinks: jsonl (metrics.jsonl, always written), tensorboard, wandb, mlflow",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="times the run restarts itself from its last checkpoint after a failure a restart can "
        "fix (a trainer rank that died or missed its deadline); 0 = stop with the error",
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "gc_threshold" in data:
            raise ValueError(
                f"run.gc_threshold={data['gc_threshold']!r}: this key was removed (agentrl no longer tunes "
                "Python's garbage collector); delete it from the config"
            )
        return data

    @model_validator(mode="after")
    def _eval_samples_can_differ(self) -> RunSection:
        if self.eval_temperature == 0.0 and self.eval_samples > 1:
            raise ValueError(
                f"eval_samples={self.eval_samples} with eval_temperature=0: greedy samples are all the same; "
                "use eval_samples: 1, or a temperature > 0 for pass@k"
            )
        return self


class ModelSection(_Section):
    """The policy model: a local directory, a built-in alias or a hub id."""

    path: str = Field(
        "smollm2-135m-instruct",
        description="policy to train and serve: a local directory, alias smollm2-135m-instruct or a hub id",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="default engine.dtype (not the trainer's dtype); auto = the checkpoint's own dtype",
    )


class WarmStartSection(_Section):
    """Optional SFT before RL: on the env's demonstrations or a past run's good episodes."""

    steps: int = Field(0, ge=0, description="SFT steps before RL; 0 = no warm start")
    source: Literal["demonstrations", "store"] = Field(
        "demonstrations",
        description="SFT data: the env's demonstrations or a past run's stored episodes (store_path)",
    )
    batch_size: int = Field(8, ge=1, description="SFT samples per step (the samples are cycled through)")
    store_path: str | None = Field(None, description="trajectories.sqlite of a past run (source=store)")
    min_reward: float = Field(1.0, description="keep stored episodes with reward >= this (source=store)")

    @model_validator(mode="after")
    def _store_needs_path(self) -> WarmStartSection:
        if self.steps and self.source == "store" and not self.store_path:
            raise ValueError("warm_start.source='store' needs warm_start.store_path")
        return self


POLICY_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
"""What a policy may be called: it names an adapter, a metrics prefix and a checkpoint folder."""

ANY_AGENT = "*"
"""`agents:` key for every agent the mapping does not name (a single-agent env's one agent is `agent`)."""


class PolicySection(_Section):
    """One named policy of a multi-policy run (`policies: {alice: {...}, bob: {...}}`).

    A trained policy is a LoRA adapter over the run's one base model (`model.path`)
    with its own optimizer, trainer settings, metrics (`policy/<name>/...`) and
    checkpoint. A fixed policy (`train: false`) samples and never trains: the base
    model alone (`adapter: false`), a frozen checkpoint (`init:`), or moves the env
    makes itself (`opponent: random|scripted`, envs with `OpponentMoves`).
    """

    train: bool = Field(True, description="train this policy; false: a fixed opponent (it samples, never trains)")
    trainer: dict[str, Any] = Field(
        default_factory=dict,
        description="this policy's trainer params over the run's trainer section (e.g. lr, kl, advantage settings)",
    )
    adapter: bool = Field(True, description="sample with this policy's LoRA adapter; false: the base model alone")
    init: str | None = Field(None, description="a checkpoint directory (of `agentrl train`) this policy starts from")
    opponent: Literal["random", "scripted"] | None = Field(
        None, description="the env moves for this policy (random or its scripted strategy); implies train: false"
    )

    @model_validator(mode="after")
    def _fixed_kinds(self) -> PolicySection:
        if self.opponent is not None and self.train:
            raise ValueError(f"opponent={self.opponent!r} moves come from the env, not a model: set train: false")
        if not self.adapter and self.train:
            raise ValueError("adapter: false samples with the untrained base model: set train: false")
        return self


class PluginSpec(BaseModel):
    """`{name: <plugin>, <param>: <value>, ...}`; params are checked by the plugin's Config."""

    model_config = ConfigDict(extra="allow")

    name: str
    _config: BaseModel | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`env: calculator` means `env: {name: calculator}`."""
        return {"name": data} if isinstance(data, str) else data

    @property
    def params(self) -> dict[str, Any]:
        """Every key but `name` (after `load_config`: the validated params with defaults)."""
        return dict(self.model_extra or {})

    @property
    def config(self) -> BaseModel | None:
        """The plugin's validated Config object (None before validation or without a Config)."""
        return self._config


# plugin section -> registry kind
PLUGIN_SECTIONS: dict[str, str] = {
    "env": "envs",
    "engine": "engines",
    "trainer": "trainers",
}

NOT_RUN_LEVEL: dict[str, str] = {
    "sandbox": "a sandbox belongs to the env that runs code: set env.sandbox (e.g. {name: docker})",
    "reward": "the env scores its episodes: set the env's reward keys (e.g. env.rewards for dataset and math)",
}
"""Sections a run config does not have, with where their settings go instead."""


DEFAULT_PLUGINS: dict[str, str] = {"engine": "hf", "trainer": "torch"}

DERIVED: dict[tuple[str, str], tuple[str, str]] = {
    ("engine", "model"): ("model.path", "the engine serves the policy the trainer trains"),
    ("engine", "seed"): ("run.seed", "a run has one seed"),
    ("trainer", "temperature"): (
        "rollout.sampling.temperature",
        "the trainer must score tokens under the distribution the engine sampled from",
    ),
    ("trainer", "seed"): ("run.seed", "a run has one seed"),
}
"""(section, param) -> (the run key it is set from, why): applied where the plugin's Config has the param."""

DERIVED_HINTS: dict[tuple[str, str], str] = {
    ("trainer", "temperature"): (
        "the trainer's logprobs need a sampling distribution (logits / temperature), which greedy decoding "
        "(0) does not have; for greedy held-out evaluation set run.eval_temperature: 0 instead"
    ),
}
"""What to say when a run key's value is one its derived plugin param refuses (beyond the field's own rule)."""


class RunConfig(_Section):
    """Everything one `agentrl train` needs."""

    run: RunSection = Field(
        RunSection.model_validate({}), description="run directory, length, checkpoints, evaluation, loggers"
    )
    model: ModelSection = Field(ModelSection.model_validate({}), description="the policy model")
    env: PluginSpec = Field(description="env plugin and its params (required; `env: NAME` = {name: NAME})")
    engine: PluginSpec = Field(
        PluginSpec(name=DEFAULT_PLUGINS["engine"]),
        description="inference engine plugin and its params; its model/dtype default to the model section",
    )
    trainer: PluginSpec = Field(
        PluginSpec(name=DEFAULT_PLUGINS["trainer"]), description="trainer plugin and its params"
    )
    rollout: RolloutConfig = Field(
        RolloutConfig.model_validate({}), description="grouping, concurrency, staleness, budgets, failures"
    )
    warm_start: WarmStartSection = Field(
        WarmStartSection.model_validate({}), description="optional SFT steps before RL"
    )
    alerts: AlertsSection = Field(
        AlertsSection.model_validate({}), description="conditions that flag or stop a run going wrong"
    )
    plugins: list[str] = Field(default_factory=list, description="user modules to import for their plugins")
    policies: dict[Annotated[str, Field(pattern=POLICY_NAME)], PolicySection] = Field(
        default_factory=dict,
        description="named policies trained together (LoRA adapters over model.path); empty: one policy",
    )
    agents: dict[str, str] = Field(
        default_factory=dict,
        description="agent id -> policy name for multi-agent envs ('*': every other agent; '@task': the agent "
        "a task names in task['agent']; a single-agent env's agent is 'agent'); needs policies",
    )
    eval_agents: dict[str, str] = Field(
        default_factory=dict, description="agent id -> policy during evaluation (default: agents), e.g. a fixed opponent"
    )
    _registry: Plugins | None = PrivateAttr(default=None)

    def registry(self) -> Plugins:
        """The Plugins this config was validated against (discovered anew if none)."""
        if self._registry is None:
            self._registry = Plugins.discover(modules=self.plugins)
        return self._registry


# --------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b=c"` -> (["a", "b"], c parsed as a YAML value)."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. rollout.group_size=4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return [p.strip() for p in parts], value


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `raw` with each `a.b=c` set; unknown keys are left for validation to reject."""
    out: dict[str, Any] = _deep_copy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"{'.'.join(parts)}: cannot set it, {where} is {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def on_path(directory: Path | None) -> Iterator[None]:
    """Make user plugin modules next to the config file importable while importing them."""
    if directory is None or str(directory) in sys.path:
        yield
        return
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(directory))


def _trainer_config_model() -> type[BaseModel] | None:
    """`agentrl.trainers.config.TrainerConfig` when it exists (it never imports torch)."""
    try:
        module = importlib.import_module("agentrl.trainers.config")
    except ModuleNotFoundError as e:
        if e.name in ("agentrl.trainers.config", "agentrl.trainers"):
            return None
        raise
    model = getattr(module, "TrainerConfig", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _run_value(config: RunConfig, dotted: str) -> Any:
    """The value at a dotted key of the run config (`rollout.sampling.temperature`)."""
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _derived_params(config: RunConfig, section: str, spec: PluginSpec, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The section's `DERIVED` params its plugin has; a given value that differs is a `ConfigError`."""
    derived: dict[str, Any] = {}
    for (where, key), (source, why) in DERIVED.items():
        if where != section or key not in fields:
            continue
        value = _run_value(config, source)
        given = spec.params.get(key, value)
        if given != value:
            raise ConfigError(f"{section}.{key}: got {given!r}, but {why}, {source}={value!r}; set {source} instead")
        _check_derived_value(source, value, f"{section}.{key}", fields[key], why, DERIVED_HINTS.get((where, key)))
        derived[key] = value
    return derived


def _check_derived_value(source: str, value: Any, target: str, field: Any, why: str, hint: str | None) -> None:
    """A run key's value that the plugin param set from it refuses is an error naming the run key the user set."""
    if not isinstance(field, FieldInfo) or field.annotation is None:
        return
    try:
        TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError as e:
        rule = str(e.errors()[0]["msg"]).removeprefix("Input should be ")
        raise ConfigError(
            f"{source}: got {value!r}; it must be {rule} because {target} is set from it ({why})"
            + (f": {hint}" if hint else "")
        ) from None


def _validate_section(plugins: Plugins, config: RunConfig, section: str, spec: PluginSpec) -> BaseModel | None:
    kind = PLUGIN_SECTIONS[section]
    registry = plugins.registry(kind)
    model: type[BaseModel] | None = None
    torch_trainer = section == "trainer" and spec.name == DEFAULT_PLUGINS["trainer"]
    if torch_trainer:
        # The torch trainer's module imports torch: check the name without loading it
        # and validate params with its torch-free TrainerConfig. Other trainers (the
        # `ray` group, a user's) are loaded and validate with their own Config.
        model = _trainer_config_model()
        if model is not None and ":" not in spec.name:
            registry.entry(spec.name)
    else:
        found = getattr(registry.get(spec.name), "Config", None)
        model = found if isinstance(found, type) and issubclass(found, BaseModel) else None
    fields = model.model_fields if model is not None else {}
    defaults = {"dtype": config.model.dtype} if section == "engine" and "dtype" in fields else {}  # engine.dtype wins
    params = {**defaults, **spec.params, **_derived_params(config, section, spec, fields)}
    if torch_trainer and model is not None:
        try:
            return model.model_validate(params)
        except ValidationError as e:
            raise config_error(e, prefix=section, model=model) from None
    return plugins.validate_params(kind, spec.name, params, prefix=section)


def resolve_config(
    raw: Mapping[str, Any] | None,
    overrides: Sequence[str] = (),
    *,
    plugins: Plugins | None = None,
    base_dir: Path | None = None,
) -> RunConfig:
    """Validate a config dict (plus overrides) into a fully resolved RunConfig."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    data = _without_legacy_keys(apply_overrides(raw, overrides))
    for key, where in NOT_RUN_LEVEL.items():
        if key in data:
            raise ConfigError(f"{key}: not a run-level section; {where}")
    for section, name in DEFAULT_PLUGINS.items():  # `trainer.lr=...` alone keeps the default trainer
        spec = data.setdefault(section, {})
        if isinstance(spec, dict):
            spec.setdefault("name", name)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e, model=RunConfig) from None
    _check_policies(config)
    with on_path(base_dir):
        if plugins is None:
            plugins = Plugins.discover(modules=config.plugins)
        else:
            for module in config.plugins:
                plugins.add_module(module)
    updates: dict[str, PluginSpec] = {}
    for section in PLUGIN_SECTIONS:
        spec = getattr(config, section)
        try:
            validated = _validate_section(plugins, config, section, spec)
        except PluginError as e:
            raise ConfigError(f"{section}.name: {e}") from None
        updates[section] = _resolved(spec.name, validated)
    config = config.model_copy(update=updates)
    _validate_policy_trainers(plugins, config)
    config = _route_gateway_policies(config)
    trainer_raw = data.get("trainer")
    _check_sections_agree(config, trainer_device_set=isinstance(trainer_raw, dict) and "device" in trainer_raw)
    config._registry = plugins
    return config


def _resolved(name: str, validated: BaseModel | None) -> PluginSpec:
    """A plugin section after validation: its params with every default filled in, the Config object kept."""
    spec = PluginSpec.model_validate({"name": name, **(validated.model_dump() if validated is not None else {})})
    spec._config = validated
    return spec


def _check_policies(config: RunConfig) -> None:
    """`agents:`/`eval_agents:` name policies of `policies:`, one of which trains."""
    for key in ("agents", "eval_agents"):
        mapping: dict[str, str] = getattr(config, key)
        if mapping and not config.policies:
            raise ConfigError(f"{key}: maps agents to policies, but the run has no policies: section")
        for agent, policy in mapping.items():
            if policy not in config.policies:
                raise ConfigError(f"{key}.{agent}: policy {policy!r} is not one of policies: {sorted(config.policies)}")
    if config.policies:
        if not any(p.train for p in config.policies.values()):
            raise ConfigError(f"policies: none of {sorted(config.policies)} trains; set train: true on one")
        if not config.agents:
            raise ConfigError(
                "agents: a run with policies: maps agent ids to them, e.g. {player_0: alice, player_1: bob}, "
                "or {'*': alice} for self-play"
            )


def _validate_policy_trainers(plugins: Plugins, config: RunConfig) -> None:
    """Each trained policy's trainer params (the run's, then its own) are valid trainer params, with LoRA."""
    for name, policy in config.policies.items():
        prefix = f"policies.{name}.trainer"
        merged = PluginSpec.model_validate({"name": config.trainer.name, **config.trainer.params, **policy.trainer})
        try:
            validated = _validate_section(plugins, config, "trainer", merged)
        except ConfigError as e:
            raise ConfigError(str(e).replace("trainer.", f"{prefix}.", 1)) from None
        lora = getattr(validated, "lora", None) if validated is not None else None
        if policy.train and validated is not None and "lora" in type(validated).model_fields and lora is None:
            raise ConfigError(
                f"{prefix}.lora: a trained policy of a multi-policy run is a LoRA adapter over the shared base; "
                "set trainer.lora: {r: 16} (or per policy)"
            )


def _route_gateway_policies(config: RunConfig) -> RunConfig:
    """A multi-policy run whose env serves its agents a gateway (`env.gateway`, the `agent` env): the
    request's `model` picks the policy.

    `gateway.model_policies` defaults to each policy with an adapter under its own name (an agent that
    asks for `model="alice"` is sampled by alice), and `gateway.default_policy` to the policy `agents:`
    gives the env's one agent (`agent`, or `*`), so agent code naming any other model trains that policy.
    Names of the user's own mapping must be policies of the run with an adapter.
    """
    env = config.env.config
    gateway: Any = getattr(env, "gateway", None) if env is not None else None
    if not config.policies or env is None or not hasattr(gateway, "model_policies"):  # an agentrl GatewayConfig
        return config
    with_adapter = sorted(name for name, p in config.policies.items() if p.adapter)
    mapping = gateway.model_policies or {name: name for name in with_adapter}
    default = gateway.default_policy
    if default is None:
        with contextlib.suppress(KeyError):  # no policy for the env's agent: unknown models stay a 404
            default = Roster(agents=config.agents).seat(SINGLE_AGENT).policy
    for key, policy in [*(("model_policies." + m, p) for m, p in mapping.items()), ("default_policy", default)]:
        if policy is not None and policy not in with_adapter:
            raise ConfigError(f"env.gateway.{key}: policy {policy!r} is not one of the run's policies with an "
                              f"adapter: {with_adapter}")  # fmt: skip
    routed = env.model_copy(update={"gateway": gateway.model_copy(update={"model_policies": mapping,
                                                                           "default_policy": default})})
    return config.model_copy(update={"env": _resolved(config.env.name, routed)})


def _check_sections_agree(config: RunConfig, *, trainer_device_set: bool) -> None:
    """Rules across sections: the trainer runs on a device the user chose (`trainer_device_set`: the
    config names `trainer.device` itself), the engine holds the longest episode."""
    engine_device = str(config.engine.params.get("device", ""))
    if engine_device.startswith("cuda") and config.trainer.name == "torch" and not trainer_device_set:
        raise ConfigError(
            f"engine.device={engine_device} but trainer.device is not set: the trainer would train on the CPU "
            f"(its default); set trainer.device: {engine_device} (or another GPU), or trainer.device: cpu if "
            "that is what you want"
        )
    context = config.engine.params.get("max_model_len")
    if context is not None and context < config.rollout.max_total_tokens:
        raise ConfigError(
            f"engine.max_model_len={context} is below rollout.max_total_tokens={config.rollout.max_total_tokens}: "
            "an episode could outgrow what the engine can hold; raise the one or lower the other"
        )


def _without_legacy_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Drop keys that configs written by earlier versions hold with no effect, so their runs resume.

    Those versions wrote `sandbox: null`, `reward: null` and `rollout.reward_timeout_s: 60.0`
    into every run's config.yaml; none of them ever did anything.
    """
    for key in NOT_RUN_LEVEL:
        if key in data and data[key] is None:
            del data[key]
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and rollout.get("reward_timeout_s") == 60.0:
        del rollout["reward_timeout_s"]
    return data


def load_config(
    path: str | Path, overrides: Sequence[str] = (), *, plugins: Plugins | None = None
) -> RunConfig:
    """Read a YAML config file (or a run directory's config.yaml), apply `a.b=c` overrides, validate."""
    path = Path(path)
    if path.is_dir() and (path / "config.yaml").is_file():  # a run: the config it ran with
        path = path / "config.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror or e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    return resolve_config(raw, overrides, plugins=plugins, base_dir=path.resolve().parent)


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML (loading it back gives the same config).

    `DERIVED` params are left out: they follow their run key when the YAML is loaded again
    (with overrides, too).
    """
    data = config.model_dump(mode="json")
    for section, key in DERIVED:
        data.get(section, {}).pop(key, None)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
