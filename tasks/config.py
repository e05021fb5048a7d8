"""Kiln's one config tree: every stage's section, loaded from composable YAML plus CLI overrides.

Precedence is CLI override > file (> the files it `extends`) > default. A file's mappings merge
into those of the file it extends, key by key; its lists, its values and any mapping it tags
`!replace` take the inherited one's place whole (how a config drops a domain from a mixture).
Every error names the file (or the override) that set the bad key, the key, and what was
expected, because a pipeline that runs for hours must not start on a typo. Once valid, every
domain and source the config names (mixtures, filters, quality training: `Section.references`)
is checked against collect's sources, with the same file and key.

A file may extend Kiln's own configs by their `kiln:` name (`extends: kiln:configs/default.yaml`,
`tasks.bundled`), which an installed Kiln resolves from its package, whatever folder it runs in.
Without a file, commands load the folder's default (`default_config_path`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, create_model

from kiln.tasks.bundled import is_packaged, packaged, packaged_name
from kiln.tasks.configbase import Section, read_yaml
from kiln.tasks.errors import ConfigError
from kiln.tasks.settings import KilnConfig
from kiln.tasks.stage import Registry
from kiln.tasks.stages import registry_or_default
from kiln.tasks.train.checkpoint import kept_steps


def config_model(registry: Registry | None = None) -> type[KilnConfig]:
    """`KilnConfig` with one section per stage of `registry` (default: Kiln's stages) that declares one."""
    registry = registry_or_default(registry)
    return _config_model(tuple((s.config_field, s.config_name, s.config) for s in registry if s.config is not None))


@lru_cache(maxsize=None)
def _config_model(sections: tuple[tuple[str, str, type[Section]], ...]) -> type[KilnConfig]:
    fields: dict[str, Any] = {
        field: (cls, Field(default_factory=cls, alias=name if name != field else None))
        for field, name, cls in sections
    }
    return create_model("KilnConfig", __base__=KilnConfig, **fields)


_CLI = "command line"
# a folder's own default config, first found wins (`kiln init` writes kiln.yaml; Kiln's checkout has
# configs/default.yaml); a folder with neither gets Kiln's packaged default
PROJECT_CONFIGS = ("kiln.yaml", "configs/default.yaml")
PACKAGED_DEFAULT = "kiln:configs/default.yaml"
_MAX_SHOWN = 200  # characters of a refused value an error shows: a whole section's repr would bury the message


class Replace:
    """A mapping or list tagged `!replace` in a config file: it takes the place of the inherited value."""

    def __init__(self, value: dict[str, Any] | list[Any]):
        self.value = value


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader plus the `!replace` tag."""


def _construct_replace(loader: _ConfigLoader, node: yaml.Node) -> Replace:
    if isinstance(node, yaml.MappingNode):
        return Replace(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Replace(loader.construct_sequence(node, deep=True))
    raise yaml.constructor.ConstructorError(None, None, "!replace tags a mapping or a list (a plain value always "
                                            "replaces the inherited one)", node.start_mark)


_ConfigLoader.add_constructor("!replace", _construct_replace)


def default_config_path() -> str:
    """The config a command uses when given none: the folder's own (`PROJECT_CONFIGS`), else Kiln's default."""
    return next((name for name in PROJECT_CONFIGS if Path(name).is_file()), PACKAGED_DEFAULT)


def config_chain(path: str | Path) -> list[tuple[str, Path]]:
    """The files a config that loads is made of, itself first and then each file it `extends`: (its name
    as the config says it, `kiln:...` for Kiln's own; where the file is)."""
    chain = [_config_file(path)]
    while True:
        name, file = chain[-1]
        loaded = read_yaml(file, _ConfigLoader)
        parent = loaded.get("extends") if isinstance(loaded, dict) else None
        if parent is None:
            return chain
        chain.append(_parent_file(name, file, str(parent)))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                registry: Registry | None = None) -> KilnConfig:
    """Load `path` (following `extends:`; `kiln:configs/...` is Kiln's own file), apply `key.sub=value`
    overrides, validate against the sections of `registry`'s stages (default: Kiln's). None: no file,
    only the sections' defaults."""
    data: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is not None:
        data = _load_file(*_config_file(path), origins, seen=())
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value)
        for set_key in [key, *(_leaf_keys(value, key + ".") if isinstance(value, dict) else ())]:
            origins[set_key] = f"{_CLI} ({override})"
    try:
        cfg = config_model(registry).model_validate(data)
    except ValidationError as error:
        raise ConfigError(_explain(error, origins)) from None
    check_references(cfg, origins)
    check_kept_steps(cfg, origins)
    return cfg


def check_references(cfg: KilnConfig, origins: dict[str, str] | None = None) -> None:
    """ConfigError, naming the file and key of each, when the config names a domain or a source that
    `collect.sources` does not have. A config without sources (nothing to collect) is not checked."""
    collect = getattr(cfg, "collect", None)
    if collect is None or not collect.sources:
        return
    known = {"domain": collect.domains(), "source": [source.name for source in collect.sources]}
    problems: dict[tuple[str, str, str], list[str]] = {}
    for ref in cfg.names_used():
        for name in ref.names:
            if name not in known[ref.kind]:
                origin = (origins or {}).get(f"{ref.key}.{name}" if ref.keyed else ref.key, "defaults")
                problems.setdefault((origin, ref.key, ref.kind), []).append(name)
    if not problems:
        return
    lines = [f"the config names domains or sources that collect.sources does not have (its domains: "
             f"{known['domain']}; its sources: {known['source']}):"]
    lines += [f"  {origin}: {key}: {kind}s {names} are not in collect.sources" for (origin, key, kind), names in problems.items()]
    lines.append("Name only the sources' domains and sources (a source's domain_field adds its `domains`). A config "
                 "that extends another replaces an inherited mapping with `!replace` (sweep: {mixtures: !replace "
                 "{mine: {news: 1}}}); a list always replaces the inherited one.")
    raise ConfigError("\n".join(lines))


def check_kept_steps(cfg: KilnConfig, origins: dict[str, str] | None = None) -> None:
    """ConfigError, naming the file and key of each, for a setting that needs a train checkpoint the keep
    policy (`train.run`'s checkpoint_every, keep_checkpoints, keep_every) will not leave on disk:
    `anneal.from_step`, `anneal_ablation.from_step`, `continuous_eval.every`. Found when the stage
    starts, such a mistake costs the whole training before it."""
    train = getattr(cfg, "train", None)
    if train is None:
        return
    run = train.run
    every = run.checkpoint_every
    # with `model: plan` and no steps of its own, the run's length comes from the fit
    planned = train.model == "plan" and "steps" not in run.model_fields_set
    kept = None if planned else kept_steps(run.steps, every, run.keep_checkpoints, run.keep_every)
    problems = []
    for key in ("anneal.from_step", "anneal_ablation.from_step"):
        section, name = key.split(".")
        step = getattr(getattr(cfg, section, None), name, None)
        if step is None:
            continue
        where = f"{_origin_of(key, origins or {})}: {key}={step}"
        if step % every or step == 0:
            problems.append(f"{where}: the train run writes no checkpoint of step {step} (one every "
                            f"train.run.checkpoint_every={every} steps); choose a multiple, or null for the final model")
        elif kept is not None and step > run.steps:
            problems.append(f"{where}: the train run stops at train.run.steps={run.steps}, before step {step}; "
                            "choose a kept step, or null for the final model")
        elif kept is None and (run.keep_every is None or step % run.keep_every):
            problems.append(f"{where}: train.run.steps comes from the fit's plan (train.model: plan), so only "
                            f"train.run.keep_every can promise that step {step} is kept: set train.run.keep_every={step}")
        elif kept is not None and step not in kept:
            problems.append(f"{where}: the train run ({run.steps} steps, keep_checkpoints={run.keep_checkpoints}, "
                            f"keep_every={run.keep_every}) will keep the checkpoints of steps {kept} only; set "
                            f"train.run.keep_every={step} to keep it, choose a kept step, or null for the final model")
    ce = getattr(cfg, "continuous_eval", None)
    if ce is not None and ce.every is not None:
        where = f"{_origin_of('continuous_eval.every', origins or {})}: continuous_eval.every={ce.every}"
        if ce.every % every:
            problems.append(f"{where} is not a multiple of train.run.checkpoint_every={every}: training writes "
                            f"checkpoints only at multiples of {every}, so some due steps would never exist; choose a "
                            "multiple (or leave continuous_eval.every unset to evaluate every checkpoint)")
        elif kept is not None and ce.every > run.steps:
            problems.append(f"{where}: no checkpoint is due, the train run stops at train.run.steps={run.steps}; "
                            "choose a smaller one (or leave it unset to evaluate every checkpoint)")
    if problems:
        raise ConfigError("the config asks for train checkpoints the run will not keep:\n"
                          + "\n".join(f"  {problem}" for problem in problems))


def _config_file(path: str | Path) -> tuple[str, Path]:
    """(the name errors give, the file) of a config named by the user: a path, or `kiln:...`."""
    if is_packaged(path):
        return str(path), packaged(str(path))
    return str(path), Path(path)


def _parent_file(name: str, path: Path, parent: str) -> tuple[str, Path]:
    """The file that the config `name` at `path` extends: `kiln:...`, or a path relative to `path`'s folder
    (a `kiln:` file's relative parent is Kiln's file too, and is named so)."""
    if is_packaged(parent):
        return parent, packaged(parent)
    file = path.parent / parent
    return (packaged_name(file) if is_packaged(name) else None) or os.path.normpath(file), file


def _load_file(name: str, path: Path, origins: dict[str, str], seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {name} does not exist (check the path; Kiln's own configs are "
                          f"kiln:configs/default.yaml and kiln:configs/tiny.yaml; `kiln init DIR` writes a project's)")
    if path.resolve() in seen:
        raise ConfigError(f"{name}: `extends` forms a cycle through {' -> '.join(map(str, seen))}")
    loaded = read_yaml(path, _ConfigLoader) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{name}: expected a mapping of sections at the top level, got {type(loaded).__name__}")
    base: dict[str, Any] = {}
    parent = loaded.pop("extends", None)
    if parent is not None:
        base = _load_file(*_parent_file(name, path, str(parent)), origins, seen + (path.resolve(),))
    for key in _leaf_keys(loaded):
        origins[key] = name
    return _deep_merge(base, loaded)


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not of the form key.sub=value (e.g. train.run.steps=500)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key, anything else (and a `Replace`) takes the place of
    the value below; the result holds no `Replace`."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = _plain(value)
    return merged


def _plain(value: Any) -> Any:
    """`value` with every `Replace` inside it unwrapped."""
    if isinstance(value, Replace):
        value = value.value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        value = value.value if isinstance(value, Replace) else value
        if isinstance(value, dict):
            keys.extend(_leaf_keys(value, dotted + "."))
    return keys


def _explain(error: ValidationError, origins: dict[str, str]) -> str:
    lines = ["invalid config:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]).replace("validate_", "validate")
        origin = _origin_of(key, origins)
        if item["type"] == "extra_forbidden":
            what = "unknown key (check the spelling; `kiln config --help` shows how to list valid keys)"
        else:
            got = repr(item.get("input"))
            what = f"{item['msg']} (got {got if len(got) <= _MAX_SHOWN else got[:_MAX_SHOWN] + '…'})"
        lines.append(f"  {origin}: {key or '<top level>'}: {what}")
    return "\n".join(lines)


def _origin_of(key: str, origins: dict[str, str]) -> str:
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:end]))
        if origin:
            return origin
    return "defaults"
