"""The base class of every config section, the marker for runtime-only fields, and the YAML reader.

A section's *identity* (what goes into a stage key) is every field except those marked
`runtime_field`: settings like worker counts or log levels change how a stage runs,
never what it produces, so they must never change an output's address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import ConfigError

_RUNTIME = "kiln_runtime"


class Section(BaseModel):
    """A frozen config section that rejects unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def identity(self) -> dict[str, Any]:
        """The fields that define this section's outputs (runtime fields dropped), recursively."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get(_RUNTIME):
                continue
            out[name] = _identity_of(getattr(self, name))
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


def read_yaml(path: Path) -> Any:
    """`path`'s YAML document (None when empty); a `ConfigError` naming the file and line when it is
    not valid YAML, or not UTF-8."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the config as UTF-8") from None
