"""User-facing errors and the one place that turns pydantic errors into plain lines.

Every error a user can fix (a bad config value, an unknown plugin name, an env
that breaks the contract) derives from `AgentrlError`; the CLI prints its
message as one clean line instead of a traceback.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


class AgentrlError(Exception):
    """An error whose message alone tells the user what to fix.

    `restartable` marks failures that a fresh start from the last checkpoint
    can get past (a trainer rank that died): `agentrl train` then restarts
    itself, up to `run.max_restarts` times.
    """

    restartable: typing.ClassVar[bool] = False


class ConfigError(AgentrlError, ValueError):
    """A run config or plugin parameters are invalid (key path, value, what is allowed)."""


class PluginError(AgentrlError, LookupError):
    """A plugin cannot be found, loaded, or is registered twice."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name`, or None if nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in an annotation like `Sub`, `Sub | None` or `Optional[Sub]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _field_names(model: type[BaseModel] | None, loc: Sequence[int | str]) -> list[str] | None:
    """Field names of the (sub)model found by walking `loc` from `model`."""
    current = model
    for part in loc:
        if current is None:
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = model_in(field.annotation)
    return list(current.model_fields) if current is not None else None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(
    error: ValidationError, *, prefix: str = "", model: type[BaseModel] | None = None
) -> list[str]:
    """One line per problem: `key.path: got VALUE; what is allowed`.

    `prefix` is prepended to every key path (e.g. "rollout" or "env"); `model`
    lets unknown keys suggest the closest known field.
    """
    lines = []
    for err in error.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = ".".join(str(p) for p in [*([prefix] if prefix else []), *loc]) or "(top level)"
        kind = err["type"]
        if kind == "missing":
            lines.append(f"{path}: required key is missing")
        elif kind == "extra_forbidden":
            known = _field_names(model, loc[:-1]) or []
            hint = closest(str(loc[-1]), known) if loc else None
            if hint:
                lines.append(f"{path}: unknown key; did you mean {hint!r}?")
            else:
                listing = f" (known keys: {', '.join(known)})" if known else ""
                lines.append(f"{path}: unknown key{listing}")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            lines.append(f"{path}: got {_short(err.get('input'))}; {msg}")
    return lines


def config_error(error: ValidationError, *, prefix: str = "", model: type[BaseModel] | None = None) -> ConfigError:
    """A ConfigError whose message lists every problem on one line."""
    lines = format_validation_error(error, prefix=prefix, model=model)
    if len(lines) == 1:
        return ConfigError(lines[0])
    return ConfigError(f"{len(lines)} problems: " + "; ".join(lines))
