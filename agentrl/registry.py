"""Plugin registries: envs, tools, rewards, sandboxes, engines, trainers, tool parsers.

There is no global registry. A run builds one `Plugins` object::

    plugins = Plugins.discover(modules=["my_project.envs"])
    env_cls = plugins.envs.get("calculator")
    env = plugins.create_env("calculator", {"max_value": 100})

Sources, all treated alike:
- entry points in the groups `agentrl.<kind>` of installed distributions, kept as
  "module:attr" strings and imported only when first used;
- objects marked by the decorators `@agentrl.env("name")`, `@agentrl.reward("name")`
  (or `@plugin(kind, name)`) and `Tool` objects made by `@agentrl.tool`, found in the
  user modules passed to `discover`;
- explicit "module:attr" strings, added with `registry.add` or passed straight to
  `registry.get("pkg.mod:Attr")`.

An unknown name raises a `PluginError` that lists what is available and the
closest match; one name claimed by two different objects raises one that names
both sources. Descriptions for `agentrl list` are read from the plugin's source
code (class `description` or docstring) without importing it where possible.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from agentrl.env import Env, EnvConfig
from agentrl.errors import ConfigError, PluginError, closest, config_error
from agentrl.plugin_entry import KINDS as KINDS  # re-exported: callers list kinds from here
from agentrl.plugin_entry import SINGULAR as SINGULAR
from agentrl.plugin_entry import Entry

MARKER = "__agentrl_plugin__"
"""Attribute set by the decorators: (kind, name)."""

T = TypeVar("T")


# --------------------------------------------------------------------------- decorators


def plugin(kind: str, name: str) -> Callable[[T], T]:
    """Mark `obj` as the plugin `name` of `kind`; `Plugins.discover(modules=...)` finds it."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are: {', '.join(KINDS)}")

    def mark(obj: T) -> T:
        setattr(obj, MARKER, (kind, name))
        return obj

    return mark


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def env(name: str | type[Env]) -> Any:
    """Class decorator: `@agentrl.env("name")` registers an Env subclass under `name`.

    Used bare (`@agentrl.env`) the name is the class's `name` or its snake_case name.
    """

    def mark(cls: type[Env], env_name: str) -> type[Env]:
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise TypeError(f"@agentrl.env({env_name!r}) decorates Env subclasses, not {cls!r}")
        cls.name = env_name
        setattr(cls, MARKER, ("envs", env_name))
        return cls

    if isinstance(name, type):
        return mark(name, name.name or _snake(name.__name__))
    return lambda cls: mark(cls, name)


def reward(name: str) -> Callable[[T], T]:
    """`@agentrl.reward("name")` on a Reward class or an `async def (task, messages)` function."""

    def mark(obj: T) -> T:
        if not callable(obj):
            raise TypeError(f"@agentrl.reward({name!r}) decorates a class or a function, not {obj!r}")
        setattr(obj, MARKER, ("rewards", name))
        return obj

    return mark


# --------------------------------------------------------------------------- registries


def _check_env(obj: Any, entry: Entry) -> type[Env]:
    if isinstance(obj, type) and issubclass(obj, Env):
        return obj
    raise PluginError(f"env {entry.name!r} ({entry.source}) is {obj!r}, not an agentrl Env subclass")


def _tool_type() -> type | None:
    try:
        tools = importlib.import_module("agentrl.tools")
    except ImportError:
        return None
    tool_type = getattr(tools, "Tool", None)
    return tool_type if isinstance(tool_type, type) else None


def _is_tool(obj: Any) -> bool:
    tool_type = _tool_type()
    if tool_type is not None:
        return isinstance(obj, tool_type)
    return not isinstance(obj, type) and all(hasattr(obj, a) for a in ("name", "schema", "call"))


def _check_tool(obj: Any, entry: Entry) -> Any:
    if _is_tool(obj):
        return obj
    if callable(obj) and not isinstance(obj, type):
        tools = importlib.import_module("agentrl.tools")  # a plain typed function becomes a Tool
        return tools.tool(obj, name=entry.name)
    raise PluginError(f"tool {entry.name!r} ({entry.source}) is {obj!r}, not a Tool or a function")


def _check_callable(obj: Any, entry: Entry) -> Any:
    if callable(obj) or hasattr(obj, "score"):
        return obj
    raise PluginError(f"{SINGULAR[entry.kind]} {entry.name!r} ({entry.source}) is {obj!r}, not a class or callable")


class Registry(Generic[T]):
    """The plugins of one kind, by name. Entries load on first `get`."""

    def __init__(self, kind: str, check: Callable[[Any, Entry], T]) -> None:
        self.kind = kind
        self._check = check
        self._entries: dict[str, Entry] = {}

    @property
    def label(self) -> str:
        return SINGULAR[self.kind]

    def add(self, name: str, target: str | object, *, source: str) -> None:
        """Register `target` ("module:attr" string or the object itself) as `name`."""
        if isinstance(target, str):
            new = Entry(self.kind, name, source, target=target)
        else:
            new = Entry(self.kind, name, source, target=_qualified(target), obj=target)
        old = self._entries.get(name)
        if old is None:
            self._entries[name] = new
            return
        if old.target is not None and old.target == new.target:
            return
        try:
            same = old.load() is new.load()
        except PluginError:
            same = False
        if not same:
            raise PluginError(
                f"{self.label} {name!r} is registered twice: by {old.source} and by {new.source}; "
                f"rename one or uninstall one"
            )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> Entry:
        """The entry for `name`; a "module:attr" string not registered yet is added."""
        found = self._entries.get(name)
        if found is not None:
            return found
        if ":" in name:
            self.add(name, name, source=f"the string {name!r}")
            return self._entries[name]
        available = self.names()
        hint = closest(name, available)
        listing = ", ".join(available) if available else "none are installed"
        did_you_mean = f"; did you mean {hint!r}?" if hint else ""
        raise PluginError(f"unknown {self.label} {name!r}{did_you_mean} (available: {listing})")

    def get(self, name: str) -> T:
        """The plugin object (imported now if it was a lazy entry point)."""
        entry = self.entry(name)
        checked = self._check(entry.load(), entry)
        entry.obj = checked
        return checked

    def describe(self, name: str) -> str:
        return self.entry(name).description()

    def rows(self) -> list[tuple[str, str, str]]:
        """(name, one-line description, source) for every entry, sorted by name."""
        return [(n, self._entries[n].description(), self._entries[n].source) for n in self.names()]


def _qualified(obj: object) -> str | None:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        return f"{module}:{qualname}"
    return None


class Plugins:
    """All registries of one run. Build with `Plugins.discover()`; never shared globally."""

    def __init__(self) -> None:
        self.envs: Registry[type[Env]] = Registry("envs", _check_env)
        self.tools: Registry[Any] = Registry("tools", _check_tool)
        self.rewards: Registry[Any] = Registry("rewards", _check_callable)
        self.sandboxes: Registry[Any] = Registry("sandboxes", _check_callable)
        self.engines: Registry[Any] = Registry("engines", _check_callable)
        self.trainers: Registry[Any] = Registry("trainers", _check_callable)
        self.tool_parsers: Registry[Any] = Registry("tool_parsers", _check_callable)
        self._env_keywords: dict[type[Env], tuple[str, ...]] = {}  # per env class: which of plugins=, resources=

    @classmethod
    def discover(cls, modules: Sequence[str | ModuleType] = (), *, entry_points: bool = True) -> Plugins:
        """Entry points of installed distributions plus decorated objects in `modules`."""
        plugins = cls()
        if entry_points:
            plugins.add_entry_points()
        for module in modules:
            plugins.add_module(module)
        return plugins

    def registry(self, kind: str) -> Registry[Any]:
        if kind not in KINDS:
            hint = closest(kind, KINDS)
            did_you_mean = f"; did you mean {hint!r}?" if hint else ""
            raise PluginError(f"unknown plugin kind {kind!r}{did_you_mean} (kinds: {', '.join(KINDS)})")
        reg: Registry[Any] = getattr(self, kind)
        return reg

    def add_entry_points(self) -> None:
        """Register (lazily) every entry point in the groups `agentrl.<kind>`."""
        for kind in KINDS:
            for ep in importlib.metadata.entry_points(group=f"agentrl.{kind}"):
                dist = ep.dist
                origin = f"distribution {dist.name} {dist.version}" if dist is not None else "an unknown distribution"
                self.registry(kind).add(ep.name, ep.value, source=f"entry point {ep.value!r} of {origin}")

    def add_module(self, module: str | ModuleType) -> None:
        """Import `module` and register every decorated plugin and every Tool in it."""
        if isinstance(module, str):
            try:
                module = importlib.import_module(module)
            except ImportError as e:
                raise PluginError(f"cannot import plugin module {module!r}: {e}") from e
        source = f"module {module.__name__}"
        for _, obj in sorted(vars(module).items()):
            marker = _own_marker(obj)
            if marker is not None:
                kind, name = marker
                self.registry(kind).add(name, obj, source=source)
            elif _is_tool(obj):
                self.tools.add(obj.name, obj, source=source)

    def validate_params(self, kind: str, name: str, params: Mapping[str, Any], *, prefix: str) -> BaseModel | None:
        """Validate `params` with the plugin's own `Config`; errors name `prefix.key`.

        Returns the validated config, or None when the plugin has no Config (then
        `params` must be empty).
        """
        obj = self.registry(kind).get(name)
        model = getattr(obj, "Config", None)
        if isinstance(model, type) and issubclass(model, BaseModel):
            try:
                # the context lets a plugin's Config check the plugins it names (e.g. an env's sandbox)
                return model.model_validate(dict(params), context={"plugins": self})
            except ValidationError as e:
                raise config_error(e, prefix=prefix, model=model) from None
        if params:
            keys = ", ".join(f"{prefix}.{k}" for k in params)
            raise ConfigError(f"{keys}: {SINGULAR[kind]} {name!r} takes no parameters (it has no Config)")
        return None

    def env_config(self, name: str, params: Mapping[str, Any] | None = None) -> EnvConfig:
        """The validated config of env `name` (errors name `env.<key>`)."""
        config = self.validate_params("envs", name, params or {}, prefix="env")
        assert isinstance(config, EnvConfig), f"env {name!r} Config must subclass EnvConfig"
        return config

    def create_env(self, name: str, params: Mapping[str, Any] | None = None, *, resources: Any = None) -> Env:
        """Instantiate env `name` with validated `params`.

        An env whose constructor takes a `plugins` keyword gets this registry:
        the tools, rewards and sandboxes its config names then resolve against
        the run's plugins (the user's modules included), not a fresh discovery.
        One that takes `resources` gets the run's `RunResources` (when given):
        the sandboxes and verifiers it builds are shared by the run's envs and
        closed with the run.
        """
        cls = self.envs.get(name)
        config = self.env_config(name, params)
        takes = self._env_keywords.get(cls)
        if takes is None:  # inspect once per class: envs are built per episode
            takes = self._env_keywords[cls] = tuple(k for k in ("plugins", "resources") if _takes_keyword(cls, k))
        given = {"plugins": self, "resources": resources}
        return cls(config, **{k: given[k] for k in takes if given[k] is not None})

    def create_sandbox(self, name: str, params: Mapping[str, Any] | None = None, *, prefix: str = "sandbox") -> Any:
        """Instantiate sandbox plugin `name` with `params` validated by its Config (errors name `prefix.key`).

        The one way sandboxes are made (envs, the code verifier, `agentrl sandbox run`),
        so a user's sandbox plugin works wherever a built-in one does.
        """
        cls = self.sandboxes.get(name)
        config = self.validate_params("sandboxes", name, params or {}, prefix=prefix)
        if config is None:
            return cls()
        from_config = getattr(cls, "from_config", None)
        return from_config(config) if from_config is not None else cls(config)

    def create_engine(self, name: str, params: Mapping[str, Any], *, tokenizer: Any = None) -> Any:
        """Instantiate engine plugin `name` from its Config and `params` (validated there).

        Like `create_env`: an engine whose `from_config` takes a `plugins` keyword
        (one made of engines, `ray`) gets this registry, so it finds the run's plugins too.
        """
        cls = self.engines.get(name)
        config = cls.Config(**params)
        if _takes_keyword(cls.from_config, "plugins"):
            return cls.from_config(config, tokenizer=tokenizer, plugins=self)
        return cls.from_config(config, tokenizer=tokenizer)


def check_named_plugin(
    context: Mapping[str, Any] | None, kind: str, name: str, params: Mapping[str, Any] | None = None
) -> None:
    """For a Config validator: check that plugin `name` of `kind` exists and takes `params`.

    Works when the run's registry is in the validation context (`Plugins.validate_params`
    puts it there: a run config, `create_env`), so a misspelt name or option fails when
    the config loads, not in every episode; a Config built by hand is not checked.
    Raises ValueError, which pydantic reports under the field's path.
    """
    plugins = (context or {}).get("plugins")
    if not isinstance(plugins, Plugins):
        return
    try:
        if params is None:
            plugins.registry(kind).get(name)
        else:
            plugins.validate_params(kind, name, params, prefix="params")
    except PluginError as e:
        raise ValueError(f"name: {e}") from None


class PluginRef(BaseModel):
    """A plugin named inside another plugin's config, with its own params: `{name: ..., params: {...}}`.

    (A sandbox of the code env, a reward of the math env, a member of a mix.) Not to be
    confused with `agentrl.config.PluginSpec`, a run-level section (`env:`, `engine:`,
    `trainer:`) whose params sit beside `name`.

    Subclasses set `kind` (the registry kind) and declare `name` and `params`
    (their defaults, descriptions and place among the subclass's own fields).
    Name and params are checked against the run's registry when the config
    loads (`check_named_plugin`), not when the plugin is first built.
    """

    model_config = ConfigDict(extra="forbid")

    kind: ClassVar[str]
    if TYPE_CHECKING:  # declared by each subclass, so that they keep their field order
        name: str
        params: dict[str, Any]

    @model_validator(mode="after")
    def _check_now(self, info: ValidationInfo) -> Self:
        check_named_plugin(info.context, self.kind, self.name, self.params)
        return self


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn(...)` (a class or function) accepts a keyword argument called `name` (declared, not **kwargs)."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    )


def _own_marker(obj: Any) -> tuple[str, str] | None:
    """The decorator marker set on `obj` itself (not inherited from a base class)."""
    try:
        own = vars(obj).get(MARKER)
    except TypeError:
        own = None
    if isinstance(own, tuple) and len(own) == 2:
        return (str(own[0]), str(own[1]))
    return None
