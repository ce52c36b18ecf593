"""`agentrl config explain`: every key of a resolved run config, what it means and what it may be.

Each key is listed with its resolved value, type (allowed values for
literals and enums), limits (``>= 0``, ``0 < x <= 1``), default and the
`description` of its pydantic field. Plugin sections (`env`, `engine`,
`trainer`, `sandbox`, `reward`) are explained from the plugin's own
`Config`, so a user plugin's keys are documented the same way as built-in
ones. A nested section that is unset (e.g. `trainer.lora: null`) still lists
its keys, with their defaults: setting any of them turns the section on.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any, Final, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from agentrl.config import DEFAULT_PLUGINS, PLUGIN_SECTIONS, PluginSpec, RunConfig
from agentrl.errors import ConfigError, closest, model_in


class _Marker:
    """A placeholder value that no config can hold (compared by identity), shown as its text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


REQUIRED: Final = _Marker("(required)")
"""The `default` of a key that has none."""

MISSING: Final = _Marker("(not set)")
"""In a diff: the value of a key the other config does not have."""

SECRET_WORDS = frozenset({"token", "secret", "password", "apikey", "credentials", "authorization"})
"""A key (or a key inside a mapping value, like a header) with one of these words in its snake_case
name (`hf_token`), or ending in `api_key`, has its value masked: explanations get pasted into bug
reports."""

_LIMITS = (("ge", ">= {}"), ("gt", "> {}"), ("le", "<= {}"), ("lt", "< {}"),
           ("min_length", "length >= {}"), ("max_length", "length <= {}"),
           ("multiple_of", "multiple of {}"), ("pattern", "matches {}"))


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path, resolved value and documentation."""

    path: str
    type: str
    value: Any
    default: Any
    description: str
    limits: str = ""
    item_keys: tuple[KeyDoc, ...] = ()
    """For a list of sections (e.g. `env.rewards`): the keys each item takes."""

    @property
    def changed(self) -> bool:
        """Whether the value differs from the default (a required key counts as set, unless its section is unset)."""
        if self.default is REQUIRED:
            return self.value is not None
        return bool(to_jsonable_python(self.value) != to_jsonable_python(self.default))


def explain(config: RunConfig, key: str = "") -> list[KeyDoc]:
    """The keys of `config`, in config order; only `key` and the keys under it when given.

    An unknown `key` raises ConfigError naming the closest real key.
    """
    docs = list(_run_config_docs(config))
    if not key:
        return docs
    chosen = [d for d in docs if d.path == key or d.path.startswith(key + ".")]
    if not chosen:
        sections = {p for d in docs for p in _prefixes(d.path)}
        guess = closest(key, sections)
        hint = f"; did you mean {guess!r}?" if guess else "; `agentrl config explain CONFIG` lists every key"
        raise ConfigError(f"{key}: no such config key{hint}")
    return chosen


def differences(a: RunConfig, b: RunConfig) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between two configs, as (path, value in a, value in b).

    A key only one of them has (another env's keys) pairs with `MISSING`.
    """
    left = {d.path: d.value for d in explain(a)}
    right = {d.path: d.value for d in explain(b)}
    out = []
    for path in [*left, *(p for p in right if p not in left)]:
        x, y = left.get(path, MISSING), right.get(path, MISSING)
        if x is MISSING or y is MISSING or to_jsonable_python(x) != to_jsonable_python(y):
            out.append((path, x, y))
    return out


def format_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    """One line per key: ``path: A -> B``."""
    if not diffs:
        return "no differences\n"
    return "".join(f"{path}: {_show(path, x)} -> {_show(path, y)}\n" for path, x, y in diffs)


def format_docs(docs: list[KeyDoc], width: int = 100) -> str:
    """Two lines or more per key: ``path: value  [type, limits, default D]`` and the description."""
    lines = []
    for doc in docs:
        facts = ", ".join(x for x in (doc.type, doc.limits) if x)
        if doc.changed:
            facts += f", default {_show(doc.path, doc.default)}" if doc.default is not REQUIRED else ", required"
        header = f"{doc.path}: {_show(doc.path, doc.value)}  [{facts}]"
        lines.extend(textwrap.wrap(header, width, subsequent_indent="        ", break_on_hyphens=False))
        text = doc.description or "(no description)"
        lines.extend(textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    "))
        if doc.item_keys:
            lines.append("    each item:")
        for item in doc.item_keys:
            default = "required" if item.default is REQUIRED else f"default {_show(item.path, item.default)}"
            facts = ", ".join(x for x in (item.type, item.limits, default) if x)
            entry = f"{item.path}  [{facts}]: {item.description or '(no description)'}"
            lines.extend(textwrap.wrap(entry, width, initial_indent="      ", subsequent_indent="          "))
    return "\n".join(lines) + ("\n" if lines else "")


# --------------------------------------------------------------------------- walking the config


def _run_config_docs(config: RunConfig) -> Iterator[KeyDoc]:
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if name in PLUGIN_SECTIONS:
            yield from _plugin_docs(name, value)
        elif isinstance(value, BaseModel):
            yield from _model_docs(name, value)
        else:
            yield _leaf(name, field, value)


def _plugin_docs(section: str, spec: PluginSpec) -> Iterator[KeyDoc]:
    kind = PLUGIN_SECTIONS[section]
    what = f"which {section} plugin runs (`agentrl list {kind}`); its keys follow"
    yield KeyDoc(f"{section}.name", "str", spec.name, DEFAULT_PLUGINS.get(section, REQUIRED), what)
    if spec.config is not None:
        yield from _model_docs(section, spec.config)


def _model_docs(
    prefix: str, model: BaseModel | type[BaseModel], within: tuple[type, ...] = ()
) -> Iterator[KeyDoc]:
    """The keys of a section; a class (an unset optional section) gives its defaults.

    `within` holds the unset sections being listed, so a model that nests itself stops.
    """
    cls = model if isinstance(model, type) else type(model)
    for name, field in cls.model_fields.items():
        path = f"{prefix}.{name}"
        value = _default(field) if isinstance(model, type) else getattr(model, name)
        if value is REQUIRED:  # a key of an unset section that has no default: not set either
            value = None
        sub = model_in(field.annotation)
        if isinstance(value, BaseModel):
            yield from _model_docs(path, value, within)
        elif value is None and sub is not None:
            yield _leaf(path, field, value, fallback=_first_line(sub.__doc__))
            if sub not in within:
                yield from _model_docs(path, sub, (*within, sub))
        elif isinstance(value, list) and sub is not None:  # a list of sections: one doc, item keys inside
            items = tuple(_leaf(name, f, _default(f)) for name, f in sub.model_fields.items())
            yield dataclasses.replace(_leaf(path, field, value), item_keys=items)
        else:
            yield _leaf(path, field, value)


def _leaf(path: str, field: FieldInfo, value: Any, fallback: str = "") -> KeyDoc:
    return KeyDoc(path, type_name(field.annotation), value, _default(field),
                  field.description or fallback, limits(field))


def _default(field: FieldInfo) -> Any:
    default = field.get_default(call_default_factory=True)
    return REQUIRED if default is PydanticUndefined else default


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


# --------------------------------------------------------------------------- rendering


def type_name(annotation: Any) -> str:
    """A short, readable type: ``int``, ``float | null``, ``'left' | 'right'``, ``list[str]``."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(repr(a.value if isinstance(a, enum.Enum) else a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(member.value) for member in annotation)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


def limits(field: FieldInfo) -> str:
    """The field's numeric and length constraints, e.g. ``> 0, <= 1``."""
    found = []
    for meta in field.metadata:
        for attr, text in _LIMITS:
            bound = getattr(meta, attr, None)
            if bound is not None:
                found.append(text.format(bound))
    return ", ".join(found)


def _show(path: str, value: Any, limit: int = 160) -> str:
    """A value as it would be written in the YAML config (one line, long ones cut, secrets masked)."""
    if isinstance(value, _Marker):
        return value.text
    plain = _masked(path.rsplit(".", 1)[-1], to_jsonable_python(value))
    text: str = yaml.safe_dump(plain, default_flow_style=True, width=10**6, allow_unicode=True)
    text = text.strip().removesuffix("...").strip()
    if "\n" in text:  # a multi-line string: JSON (valid YAML too) keeps it on one line
        text = json.dumps(plain, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _masked(name: str, value: Any) -> Any:
    """`value` with the values of secret-named keys replaced by ``***``."""
    words = name.lower().replace("-", "_")
    if value and (words.endswith("api_key") or not SECRET_WORDS.isdisjoint(words.split("_"))):
        return "***"
    if isinstance(value, dict):
        return {k: _masked(str(k), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked("", v) for v in value]
    return value
