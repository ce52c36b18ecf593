"""Plugin registry: entry points, decorators, lazy strings, errors, laziness."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import agentrl
from agentrl.env import Env, EnvConfig, StepResult
from agentrl.errors import ConfigError, PluginError
from agentrl.registry import Plugins, plugin
from agentrl.types import Message

ENV_SOURCE = '''
from pydantic import Field
import agentrl
from agentrl.env import Env, EnvConfig, StepResult
from agentrl.types import Message

MARK = []  # importing this module is observable through sys.modules


class Config(EnvConfig):
    size: int = Field(3, ge=1)


class {cls}(Env):
    """{doc}

    More text that is not part of the one-line description.
    """

    Config = Config

    def tasks(self, split="train"):
        return [{{"id": str(i)}} for i in range(self.config.size)]

    async def reset(self, task, *, seed=None):
        return [Message(role="user", content=task["id"])], {{}}

    async def step(self, action):
        return StepResult(messages=[], reward=1.0, terminated=True)
'''


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def write_module(root: Path, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


def write_dist(root: Path, dist: str, entry_points: dict[str, dict[str, str]]) -> None:
    """A minimal installed distribution (dist-info) declaring entry points."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_is_lazy_and_described_without_import(site: Path) -> None:
    mod, dist = _unique("lazy_env_mod"), _unique("lazydist")
    write_module(site, mod, ENV_SOURCE.format(cls="LazyEnv", doc="A lazily imported env."))
    write_dist(site, dist, {"agentrl.envs": {"lazy": f"{mod}:LazyEnv"}})

    plugins = Plugins.discover()
    assert "lazy" in plugins.envs.names()
    rows = {name: (desc, src) for name, desc, src in plugins.envs.rows()}
    assert rows["lazy"][0] == "A lazily imported env."
    assert dist in rows["lazy"][1] and f"{mod}:LazyEnv" in rows["lazy"][1]
    assert mod not in sys.modules, "listing must not import the plugin module"

    cls = plugins.envs.get("lazy")
    assert mod in sys.modules
    assert issubclass(cls, Env) and cls.__name__ == "LazyEnv"
    assert plugins.envs.get("lazy") is cls


def test_broken_entry_point_fails_only_when_used(site: Path) -> None:
    mod, dist = _unique("broken_mod"), _unique("brokendist")
    write_module(site, mod, 'raise RuntimeError("boom at import")\n')
    write_dist(site, dist, {"agentrl.rewards": {"broken": f"{mod}:thing"}})

    plugins = Plugins.discover()  # discovery must not import it
    assert "broken" in plugins.rewards
    with pytest.raises(PluginError) as e:
        plugins.rewards.get("broken")
    assert "broken" in str(e.value) and dist in str(e.value) and "boom at import" in str(e.value)


def test_decorated_objects_in_user_module(site: Path) -> None:
    mod = _unique("user_plugins")
    write_module(
        site,
        mod,
        ENV_SOURCE.format(cls="Base", doc="Not registered.")
        + '''
@agentrl.env("counting")
class Counting(Base):
    """Counts things."""


class Unmarked(Counting):
    """Inherits the marker attribute but is not decorated itself."""


@agentrl.reward("exact")
async def exact(task, messages):
    """1.0 when the last message equals the answer."""
    return 1.0


@agentrl.plugin("sandboxes", "nullbox")
class NullBox:
    """Runs nothing."""
''',
    )
    plugins = Plugins.discover(modules=[mod], entry_points=False)
    assert plugins.envs.names() == ["counting"]
    env_cls = plugins.envs.get("counting")
    assert env_cls.name == "counting"
    assert plugins.envs.describe("counting") == "Counts things."
    assert plugins.rewards.describe("exact") == "1.0 when the last message equals the answer."
    assert plugins.sandboxes.names() == ["nullbox"]
    assert "module " + mod in plugins.envs.entry("counting").source


def test_bare_env_decorator_uses_snake_case_name() -> None:
    @agentrl.env
    class WordLadder(Env):
        def tasks(self, split: str = "train") -> list[dict[str, str]]:
            return []

        async def reset(self, task, *, seed=None):  # type: ignore[no-untyped-def]
            return [], {}

        async def step(self, action: Message) -> StepResult:
            return StepResult(messages=[])

    assert WordLadder.name == "word_ladder"
    with pytest.raises(TypeError, match="Env subclasses"):
        agentrl.env("x")(object)


def test_lazy_module_attr_strings(site: Path) -> None:
    mod = _unique("strmod")
    write_module(site, mod, ENV_SOURCE.format(cls="StrEnv", doc="Given as a string."))
    plugins = Plugins.discover(entry_points=False)
    plugins.envs.add("str", f"{mod}:StrEnv", source="a test")
    assert mod not in sys.modules
    assert plugins.envs.describe("str") == "Given as a string."
    assert mod not in sys.modules
    assert plugins.envs.get("str").__name__ == "StrEnv"
    # An unregistered "module:attr" works directly too.
    assert plugins.envs.get(f"{mod}:StrEnv") is plugins.envs.get("str")
    with pytest.raises(PluginError, match="failed to load"):
        plugins.envs.get(f"{mod}:Missing")


def test_unknown_name_lists_available_and_closest(site: Path) -> None:
    plugins = Plugins()
    for name in ("calculator", "countdown", "frozenlake"):
        plugins.tools.add(name, f"nowhere_{name}:x", source="test")
    with pytest.raises(PluginError) as e:
        plugins.tools.get("calculater")
    msg = str(e.value)
    assert "unknown tool 'calculater'" in msg
    assert "did you mean 'calculator'?" in msg
    assert "calculator, countdown, frozenlake" in msg
    with pytest.raises(PluginError, match="none are installed"):
        Plugins().engines.get("hf2")
    with pytest.raises(PluginError, match="did you mean 'envs'"):
        plugins.registry("env")


def test_duplicate_name_from_two_sources_names_both(site: Path) -> None:
    mod_a, mod_b = _unique("dup_a"), _unique("dup_b")
    dist_a, dist_b = _unique("dista"), _unique("distb")
    write_module(site, mod_a, ENV_SOURCE.format(cls="A", doc="A."))
    write_module(site, mod_b, ENV_SOURCE.format(cls="B", doc="B."))
    write_dist(site, dist_a, {"agentrl.envs": {"twin": f"{mod_a}:A"}})
    write_dist(site, dist_b, {"agentrl.envs": {"twin": f"{mod_b}:B"}})
    with pytest.raises(PluginError) as e:
        Plugins.discover()
    msg = str(e.value)
    assert "env 'twin' is registered twice" in msg
    assert dist_a in msg and dist_b in msg


def test_duplicate_between_entry_point_and_decorator(site: Path) -> None:
    mod_ep, mod_user = _unique("ep_mod"), _unique("user_mod")
    dist = _unique("epdist")
    write_module(site, mod_ep, ENV_SOURCE.format(cls="FromDist", doc="From a distribution."))
    write_module(
        site,
        mod_user,
        ENV_SOURCE.format(cls="Mine", doc="Mine.") + '\nagentrl.env("shared")(Mine)\n',
    )
    write_dist(site, dist, {"agentrl.envs": {"shared": f"{mod_ep}:FromDist"}})
    with pytest.raises(PluginError) as e:
        Plugins.discover(modules=[mod_user])
    assert dist in str(e.value) and f"module {mod_user}" in str(e.value)


def test_same_object_from_two_sources_is_not_a_duplicate(site: Path) -> None:
    mod, dist = _unique("same_mod"), _unique("samedist")
    write_module(site, mod, ENV_SOURCE.format(cls="Same", doc="Same.") + '\nagentrl.env("same")(Same)\n')
    write_dist(site, dist, {"agentrl.envs": {"same": f"{mod}:Same"}})
    plugins = Plugins.discover(modules=[mod])  # the module re-exports the entry point's class
    assert plugins.envs.get("same").__name__ == "Same"


def test_create_env_validates_params_with_env_config(site: Path) -> None:
    mod = _unique("cfg_mod")
    write_module(site, mod, ENV_SOURCE.format(cls="Sized", doc="Sized."))
    plugins = Plugins.discover(entry_points=False)
    plugins.envs.add("sized", f"{mod}:Sized", source="test")
    env = plugins.create_env("sized", {"size": 5})
    assert len(list(env.tasks())) == 5
    with pytest.raises(ConfigError) as e:
        plugins.create_env("sized", {"size": 0})
    assert str(e.value).startswith("env.size: got 0;") and "greater than or equal to 1" in str(e.value)
    with pytest.raises(ConfigError, match=r"env\.sise: unknown key; did you mean 'size'"):
        plugins.create_env("sized", {"sise": 2})


def test_plugin_without_config_rejects_params() -> None:
    class NoConfig:
        """Takes nothing."""

    plugins = Plugins()
    plugins.engines.add("plain", NoConfig, source="test")
    assert plugins.validate_params("engines", "plain", {}, prefix="engine") is None
    with pytest.raises(ConfigError, match=r"engine\.x: engine 'plain' takes no parameters"):
        plugins.validate_params("engines", "plain", {"x": 1}, prefix="engine")


def test_wrong_kind_of_object_is_a_clear_error() -> None:
    plugins = Plugins()
    plugins.envs.add("notanenv", "collections:OrderedDict", source="test")
    with pytest.raises(PluginError, match="not an agentrl Env subclass"):
        plugins.envs.get("notanenv")
    with pytest.raises(PluginError, match="unknown plugin kind"):
        plugin("widgets", "x")


def test_tools_found_by_type_in_user_module(site: Path) -> None:
    pytest.importorskip("agentrl.tools")
    mod = _unique("tool_mod")
    write_module(
        site,
        mod,
        '''
        import agentrl

        @agentrl.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        def not_a_tool(x: int) -> int:
            return x
        ''',
    )
    plugins = Plugins.discover(modules=[mod], entry_points=False)
    assert plugins.tools.names() == ["add"]
    tool = plugins.tools.get("add")
    assert tool.schema()["function"]["name"] == "add"
    assert plugins.tools.describe("add") == "Add two integers."


def test_env_config_must_subclass_envconfig() -> None:
    class Odd(Env):
        Config = EnvConfig

        def tasks(self, split: str = "train") -> list[dict[str, str]]:
            return []

        async def reset(self, task, *, seed=None):  # type: ignore[no-untyped-def]
            return [], {}

        async def step(self, action: Message) -> StepResult:
            return StepResult(messages=[])

    plugins = Plugins()
    plugins.envs.add("odd", Odd, source="test")
    assert isinstance(plugins.create_env("odd"), Odd)


def test_public_exports() -> None:
    for name in ("Env", "StepResult", "Message", "ToolCall", "Trajectory", "Group", "env", "reward", "Plugins"):
        assert name in agentrl.__all__ and getattr(agentrl, name) is not None
    tools = pytest.importorskip("agentrl.tools")
    assert agentrl.tool is tools.tool and agentrl.Tool is tools.Tool
    with pytest.raises(AttributeError):
        agentrl.no_such_thing  # noqa: B018


async def test_plain_function_entry_becomes_a_tool(site: Path) -> None:
    pytest.importorskip("agentrl.tools")
    mod = _unique("plain_tool_mod")
    write_module(
        site,
        mod,
        '''
        def shout(text: str) -> str:
            """Upper-case the text."""
            return text.upper()
        ''',
    )
    plugins = Plugins()
    plugins.tools.add("shout", f"{mod}:shout", source="test")
    tool = plugins.tools.get("shout")
    assert tool.name == "shout" and tool.schema()["function"]["parameters"]["properties"]["text"]
    assert await tool.call({"text": "hi"}) == "HI"
    assert plugins.tools.get("shout") is tool
