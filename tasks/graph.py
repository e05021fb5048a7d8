"""The stage graph and its keys, derived from the stage declarations in `tasks.stages.REGISTRY`.

A key covers the stage's config sections (runtime fields excluded), the keys of its inputs, the
content of any files it reads from outside the store, and its format version. So changing a
setting re-runs exactly the stages whose output it can change, and nothing else;
`tests/test_graph.py` states which changes move which keys.
"""

from __future__ import annotations

from typing import Any

from kiln.tasks.configbase import Section
from kiln.tasks.fingerprint import fingerprint_paths
from kiln.tasks.settings import KilnConfig
from kiln.tasks.stage import Registry
from kiln.tasks.stages import registry_or_default
from kiln.tasks.store import stage_key


def _registry(registry: Registry | None) -> Registry:
    return registry_or_default(registry)


def config_value(cfg: KilnConfig, dotted: str) -> Any:
    """The config value at a dotted path such as `evaluate.eval_files` (a section or a field)."""
    parts = dotted.split(".")
    value: Any = cfg.section(parts[0])
    for part in parts[1:]:
        value = getattr(value, part)
    return value


def _identity_value(cfg: KilnConfig, dotted: str) -> Any:
    value = config_value(cfg, dotted)
    return value.identity() if isinstance(value, Section) else value


def stage_identity(name: str, cfg: KilnConfig, registry: Registry | None = None) -> dict[str, Any]:
    """What the stage's key hashes besides its inputs: its config sections and external files' content."""
    stage = _registry(registry)[name]
    identity = {section: _identity_value(cfg, section) for section in stage.sections}
    if stage.external_files is not None:
        identity["external_files_sha256"] = fingerprint_paths(stage.external_files(cfg))
    return identity


def stage_keys(cfg: KilnConfig, registry: Registry | None = None) -> dict[str, str]:
    """Every stage's key, computed from the config alone (no stage needs to have run)."""
    keys: dict[str, str] = {}
    for stage in _registry(registry):
        keys[stage.name] = stage_key(stage.name, stage_identity(stage.name, cfg, registry),
                                     {i: keys[i] for i in stage.inputs}, stage.version)
    return keys


def downstream_of(name: str, registry: Registry | None = None) -> list[str]:
    """`name` and every pipeline stage that (transitively) reads it, in pipeline order."""
    stages = list(_registry(registry))
    affected = {name}
    for stage in stages:
        if affected & set(stage.inputs):
            affected.add(stage.name)
    return [s.name for s in stages if s.name in affected and s.in_pipeline]
