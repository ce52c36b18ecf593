"""One registered plugin: where it comes from, how it is loaded, how it is described.

An `Entry` holds a plugin as a "module:attr" target (an entry point, imported
only when first used) or as the object itself (a decorated plugin from a user
module). Its one-line description for `agentrl list` is read from the target's
source code (class `description` or docstring) without importing it where
possible. The registries built from entries are `agentrl.registry`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from agentrl.env import Env
from agentrl.errors import PluginError

KINDS: tuple[str, ...] = ("envs", "tools", "rewards", "sandboxes", "engines", "trainers", "tool_parsers")
SINGULAR: dict[str, str] = {
    "envs": "env",
    "tools": "tool",
    "rewards": "reward",
    "sandboxes": "sandbox",
    "engines": "engine",
    "trainers": "trainer",
    "tool_parsers": "tool parser",
}
_UNLOADED: Any = object()


def _load_target(target: str) -> Any:
    """Import "pkg.module:attr.sub" and return the attribute."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PluginError(f"plugin target {target!r} is not of the form 'module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _first_line(text: str | None) -> str:
    for line in (text or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe_object(obj: Any) -> str:
    """One line: an explicit `description`, else the first docstring line."""
    desc = getattr(obj, "description", None)
    if isinstance(desc, str) and desc.strip():
        return _first_line(desc)
    doc = obj.__doc__ if isinstance(obj, type) or callable(obj) else None
    if isinstance(obj, type) and doc == Env.__doc__ and obj is not Env:
        doc = None  # inherited, says nothing about this env
    return _first_line(doc)


def _static_description(target: str) -> str | None:
    """Read a class/function description from source without importing the module."""
    module_name, _, attr = target.partition(":")
    if "." in attr or not attr:
        return None
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == attr:
            for stmt in node.body:
                target_name = None
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target_name = getattr(stmt.targets[0], "id", None)
                elif isinstance(stmt, ast.AnnAssign):
                    target_name = getattr(stmt.target, "id", None)
                value = getattr(stmt, "value", None)
                if (
                    target_name == "description"
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                    and value.value.strip()
                ):
                    return _first_line(value.value)
            return _first_line(ast.get_docstring(node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attr:
            for deco in node.decorator_list:
                for kw in getattr(deco, "keywords", []):
                    if kw.arg == "description" and isinstance(kw.value, ast.Constant):
                        return _first_line(str(kw.value.value))
            return _first_line(ast.get_docstring(node))
    return None


@dataclass(slots=True)
class Entry:
    """One registered plugin: where it comes from and (once loaded) the object."""

    kind: str
    name: str
    source: str
    target: str | None = None
    obj: Any = field(default=_UNLOADED, repr=False)

    @property
    def loaded(self) -> bool:
        return self.obj is not _UNLOADED

    def load(self) -> Any:
        if self.obj is _UNLOADED:
            assert self.target is not None
            try:
                self.obj = _load_target(self.target)
            except PluginError:
                raise
            except Exception as e:
                raise PluginError(
                    f"{SINGULAR[self.kind]} {self.name!r} ({self.source}) failed to load "
                    f"{self.target!r}: {type(e).__name__}: {e}"
                ) from e
        return self.obj

    def description(self) -> str:
        if not self.loaded and self.target is not None:
            static = _static_description(self.target)
            if static is not None:
                return static
            try:
                self.load()
            except PluginError as e:
                return f"(cannot load: {e})"
        return describe_object(self.obj)
