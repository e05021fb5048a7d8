"""The base class of every config section, the markers for runtime-only and name fields, and the YAML reader.

A section's *identity* (what goes into a stage key) is every field except those marked
`runtime_field`: settings like worker counts or log levels change how a stage runs,
never what it produces, so they must never change an output's address. A field added to a
section after keys were published (`added_field`) enters the identity only when it is set to
something other than its default, which is what every output made before it existed used: their
keys, and the checkpoints that record them, stay valid.

The names a section uses (`names_used`) of things another section defines are the domains of
collect's sources and the sources themselves (`names_field`, or a section's own `names_used` for
names that are mapping keys). The config loader checks every one when a config loads, so a
mixture naming a domain no source has fails before anything runs, not hours later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from kiln.tasks.errors import ConfigError

_RUNTIME = "kiln_runtime"
_ADDED = "kiln_added"
_NAMES = "kiln_names"
NameKind = Literal["domain", "source"]


@dataclass(frozen=True)
class Reference:
    """Names of domains or sources a config uses at `key` (dotted, from the section's root). `keyed`:
    the names are the keys of the mapping at `key` (a mixture's domains), each set under `key.<name>`."""

    key: str
    kind: NameKind
    names: tuple[str, ...]
    keyed: bool = False


class Section(BaseModel):
    """A frozen config section that rejects unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def names_used(self) -> list[Reference]:
        """The domains and sources this section names: its `names_field`s and its subsections' references."""
        found: list[Reference] = []
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            key = field.alias or name
            extra = field.json_schema_extra
            kind = extra.get(_NAMES) if isinstance(extra, dict) else None
            if kind is not None and value is not None:
                found.append(Reference(key, kind, (value,) if isinstance(value, str) else tuple(value)))
            elif isinstance(value, Section):
                found += [replace(ref, key=f"{key}.{ref.key}") for ref in value.names_used()]
        return found

    def identity(self) -> dict[str, Any]:
        """The fields that define this section's outputs (runtime fields dropped), recursively."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if is_runtime(field) or (_marked(field, _ADDED) and value == field.get_default(call_default_factory=True)):
                continue
            out[name] = _identity_of(value)
        return out


def _identity_of(value: Any) -> Any:
    if isinstance(value, Section):
        return value.identity()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_identity_of(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _identity_of(v) for k, v in value.items()}
    return value


def runtime_field(default: Any = ..., **kwargs: Any) -> Any:
    """A field that changes how a stage runs but not what it outputs: excluded from keys."""
    return Field(default, json_schema_extra={_RUNTIME: True}, **kwargs)


def added_field(default: Any, **kwargs: Any) -> Any:
    """A field added after keys were published: in the identity only when it differs from `default`
    (the value every earlier output was made with), so those outputs keep their keys."""
    return Field(default, json_schema_extra={_ADDED: True}, **kwargs)


def names_field(kind: NameKind, default: Any = ..., **kwargs: Any) -> Any:
    """A field naming collect's domains (or sources): a name, or a list of them; checked when the config loads."""
    return Field(default, json_schema_extra={_NAMES: kind}, **kwargs)


def is_runtime(field: FieldInfo) -> bool:
    """Whether a section's field (`type(section).model_fields[name]`) is a `runtime_field`."""
    return _marked(field, _RUNTIME)


def _marked(field: FieldInfo, marker: str) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(marker))


def read_yaml(path: Path, loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> Any:
    """`path`'s YAML document (None when empty); a `ConfigError` naming the file and line when it is
    not valid YAML, or not UTF-8."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506 — a SafeLoader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the config as UTF-8") from None
