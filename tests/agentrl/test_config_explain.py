"""`agentrl config explain`: every key with value, type, limits, default and meaning; every built-in key described."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from agentrl.cli import build_app
from agentrl.config import PLUGIN_SECTIONS, RunConfig, resolve_config
from agentrl.config_explain import REQUIRED, KeyDoc, explain, format_docs
from agentrl.errors import ConfigError, model_in
from agentrl.registry import Plugins

CALCULATOR = {"env": {"name": "calculator", "digits": 3}, "rollout": {"group_size": 4}}


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    return Plugins.discover()


def by_path(docs: list[KeyDoc]) -> dict[str, KeyDoc]:
    return {d.path: d for d in docs}


def test_a_key_has_its_value_type_limits_default_and_meaning(plugins: Plugins) -> None:
    docs = by_path(explain(resolve_config(CALCULATOR, plugins=plugins)))
    size = docs["rollout.group_size"]
    assert (size.value, size.default, size.type, size.limits, size.changed) == (4, 8, "int", ">= 1", True)
    assert "GRPO" in size.description
    staleness = docs["rollout.max_staleness"]
    assert not staleness.changed and staleness.limits == ">= 0" and "synchronous" in staleness.description
    assert docs["rollout.sampling.top_p"].limits == "> 0.0, <= 1.0"  # nested sections are walked
    assert docs["model.dtype"].type == "'auto' | 'bf16' | 'fp32'"  # literals list their values
    assert "'zero_reward'" in docs["rollout.on_error"].type  # enums too
    assert docs["run.loggers"].type == "list['jsonl' | 'tensorboard' | 'wandb' | 'mlflow']"


def test_plugin_sections_are_explained_from_the_plugins_own_config(plugins: Plugins) -> None:
    docs = by_path(explain(resolve_config(CALCULATOR, plugins=plugins)))
    assert docs["env.name"].value == "calculator" and docs["env.name"].default == REQUIRED
    assert docs["env.digits"].value == 3 and docs["env.digits"].changed
    assert docs["engine.name"].value == "hf" and not docs["engine.name"].changed
    assert "trainer.kl.coef" in docs and docs["trainer.lr"].limits == "> 0.0"
    assert "env.sandbox.name" not in docs and "sandbox.name" not in docs  # no run-level sandbox
    math = by_path(explain(resolve_config({"env": {"name": "math"}}, plugins=plugins)))
    assert "env.digits" not in math and "env.mode" in math


def test_an_unset_optional_section_still_lists_its_keys(plugins: Plugins) -> None:
    docs = by_path(explain(resolve_config(CALCULATOR, plugins=plugins), "trainer.lora"))
    assert docs["trainer.lora"].value is None
    rank = docs["trainer.lora.r"]
    assert rank.value == rank.default == 16 and not rank.changed  # what setting it would start from
    on = by_path(explain(resolve_config(CALCULATOR, ["trainer.lora.r=4"], plugins=plugins), "trainer.lora"))
    assert on["trainer.lora.r"].value == 4 and on["trainer.lora.r"].changed and "trainer.lora" not in on
    # a key with no default inside an unset section is not set either (and not "changed")
    buffer = by_path(explain(resolve_config(CALCULATOR, plugins=plugins), "rollout.overlong"))["rollout.overlong.buffer_tokens"]
    assert buffer.value is None and not buffer.changed
    set_ = by_path(explain(resolve_config(CALCULATOR, ["rollout.overlong.buffer_tokens=8"], plugins=plugins)))
    assert set_["rollout.overlong.buffer_tokens"].value == 8 and set_["rollout.overlong.buffer_tokens"].changed


def test_key_selects_a_key_or_section_and_a_typo_names_the_closest(plugins: Plugins) -> None:
    config = resolve_config(CALCULATOR, plugins=plugins)
    assert [d.path for d in explain(config, "rollout.max_staleness")] == ["rollout.max_staleness"]
    sampling = explain(config, "rollout.sampling")
    assert sampling and all(d.path.startswith("rollout.sampling.") for d in sampling)
    with pytest.raises(ConfigError, match="no such config key"):
        explain(config, "rollout.max")  # whole parts of a path only
    with pytest.raises(ConfigError, match=r"rollout\.stalenes: no such config key; did you mean 'rollout\.max_staleness'"):
        explain(config, "rollout.stalenes")


def test_format_shows_defaults_only_when_changed_and_masks_secrets(plugins: Plugins) -> None:
    config = resolve_config(CALCULATOR, plugins=plugins)
    text = format_docs(explain(config, "rollout.group_size") + explain(config, "rollout.max_staleness"))
    lines = text.splitlines()
    assert lines[0] == "rollout.group_size: 4  [int, >= 1, default 8]"
    assert lines[2] == "rollout.max_staleness: 1  [int, >= 0]"
    assert "rollout.max_total_tokens: 4096" in format_docs(explain(config, "rollout.max_total_tokens"))
    sandbox = {"name": "e2b", "params": {"api_key": "sk-live-123", "pool_size": 2}}
    math = resolve_config({"env": {"name": "math", "sandbox": sandbox}}, plugins=plugins)
    shown = format_docs(explain(math, "env.sandbox"))
    assert "sk-live-123" not in shown and "{api_key: '***', pool_size: 2}" in shown


def test_a_user_plugin_is_documented_like_a_built_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"explain_plugins_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent('''
        import agentrl
        from pydantic import Field
        from agentrl.env import Env, EnvConfig

        @agentrl.env("explained")
        class Explained(Env):
            class Config(EnvConfig):
                level: int = Field(2, ge=1, le=5, description="how hard the tasks are")
                undocumented: str = "x"
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = resolve_config({"env": {"name": "explained", "level": 4}, "plugins": [name]})
    text = format_docs(explain(config, "env"))
    assert "env.level: 4  [int, >= 1, <= 5, default 2]\n    how hard the tasks are\n" in text
    assert "env.undocumented: x  [str]\n    (no description)\n" in text


def _undescribed(model: type[BaseModel], prefix: str, seen: set[type[BaseModel]]) -> list[str]:
    if model in seen:
        return []
    seen.add(model)
    missing = []
    for name, field in model.model_fields.items():
        sub = model_in(field.annotation)
        if not field.description and not (sub is not None and sub.__doc__):
            missing.append(f"{prefix}.{name}")
        if sub is not None:
            missing += _undescribed(sub, f"{prefix}.{name}", seen)
    return missing


def test_every_built_in_key_is_described(plugins: Plugins) -> None:
    """`config explain` is the reference: no built-in key may leave a user guessing."""
    seen: set[type[BaseModel]] = set()
    missing = []
    for section, field in RunConfig.model_fields.items():
        model = model_in(field.annotation)
        if section not in PLUGIN_SECTIONS and model is not None:
            missing += _undescribed(model, section, seen)
        elif section not in PLUGIN_SECTIONS and not field.description:
            missing.append(section)
    from agentrl.trainers.config import TrainerConfig

    missing += _undescribed(TrainerConfig, "trainer", seen)
    checked = 0
    for kind in ("envs", "engines", "trainers", "sandboxes", "rewards", "tools"):
        registry = plugins.registry(kind)
        for name in registry.names():
            cls: Any = registry.get(name)
            config_model = getattr(cls, "Config", None)
            if isinstance(config_model, type) and issubclass(config_model, BaseModel):
                checked += 1
                missing += _undescribed(config_model, f"{kind}:{name}", seen)
    assert checked >= 12  # the built-in envs, engines, sandboxes and rewards were all looked at
    assert missing == []


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_cli_explains_a_file_overrides_alone_and_only_changed_keys(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("env: {name: calculator}\nrollout: {group_size: 4}\n")
    code, out = invoke("config", "explain", str(config), "rollout.max_staleness=0", "--key", "rollout")
    assert code == 0
    assert "rollout.group_size: 4  [int, >= 1, default 8]" in out
    assert "rollout.max_staleness: 0  [int, >= 0, default 1]" in out and "env.name" not in out
    code, out = invoke("config", "explain", str(config), "--changed")
    assert code == 0 and "rollout.group_size: 4" in out and "rollout.max_staleness" not in out
    code, out = invoke("config", "explain", "env.name=math", "-k", "env.name")  # no file: overrides alone
    assert code == 0 and out.startswith("env.name: math  [str, required]")
    code, out = invoke("config", "explain")
    assert code == 2 and "`agentrl config explain env.name=calculator`" in out
    code, out = invoke("config", "explain", str(config), "-k", "rollout.grup_size")
    assert code != 0 and "did you mean 'rollout.group_size'" in out


def test_a_section_type_that_nests_itself_is_listed_once() -> None:
    """An unset optional section is listed from its class; a class that contains itself must not loop."""
    from agentrl.config_explain import _model_docs

    class Node(BaseModel):
        """A tree of settings."""

        weight: float = 1.0
        child: Node | None = None

    Node.model_rebuild()
    paths = [d.path for d in _model_docs("tree", Node())]
    assert paths == ["tree.weight", "tree.child", "tree.child.weight", "tree.child.child"]


def test_a_list_of_sections_documents_the_keys_of_each_item(plugins: Plugins) -> None:
    config = resolve_config({"env": {"name": "math", "rewards": [{"name": "math", "weight": 2.0}]}}, plugins=plugins)
    (rewards,) = explain(config, "env.rewards")
    assert [k.path for k in rewards.item_keys] == ["name", "weight", "params"]
    text = format_docs([rewards])
    assert "\n    each item:\n      name  [str, length >= 1, required]: a registered agentrl.rewards plugin\n" in text
    assert "      weight  [float, default 1.0]: " in text


def test_diff_lists_the_keys_set_differently_and_keys_only_one_has(plugins: Plugins) -> None:
    from agentrl.config_explain import MISSING, differences, format_differences

    a = resolve_config(CALCULATOR, plugins=plugins)
    b = resolve_config({"env": {"name": "math"}, "rollout": {"group_size": 4, "max_staleness": 0}}, plugins=plugins)
    diffs = {path: (x, y) for path, x, y in differences(a, b)}
    assert diffs["env.name"] == ("calculator", "math")
    assert diffs["rollout.max_staleness"] == (1, 0) and "rollout.group_size" not in diffs  # 4 in both
    assert diffs["env.digits"] == (3, MISSING) and diffs["env.mode"] == (MISSING, "single")
    text = format_differences(differences(a, b))
    assert "rollout.max_staleness: 1 -> 0\n" in text and "env.digits: 3 -> (not set)\n" in text
    assert format_differences(differences(a, a)) == "no differences\n"


def test_cli_diff_and_explain_take_a_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("env: calculator\nrollout: {group_size: 4}\n")
    other = tmp_path / "other.yaml"
    other.write_text("env: calculator\nrollout: {group_size: 4, max_turns: 2}\nsandbox: null\n")
    code, out = invoke("config", "diff", str(run), str(other))
    assert code == 0 and out == "rollout.max_turns: 8 -> 2\n"
    code, out = invoke("config", "explain", str(run), "-k", "rollout.group_size")
    assert code == 0 and out.startswith("rollout.group_size: 4  [int, >= 1, default 8]")
