"""Kiln's one config tree: every stage's section, loaded from composable YAML plus CLI overrides.

Precedence is CLI override > file (> the files it `extends`) > default. Every error names the
file (or the override) that set the bad key, the key, and what was expected, because a
pipeline that runs for hours must not start on a typo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from tasks.configbase import Section, runtime_field
from tasks.data.clean import CleanConfig
from tasks.data.collect import CollectConfig
from tasks.data.decontaminate import DecontaminateConfig
from tasks.data.dedup import DedupConfig
from tasks.data.tokenize import TokenizeConfig
from tasks.errors import ConfigError
from tasks.evals.continuous import ContinuousEvalConfig
from tasks.evals.evaluate import EvaluateConfig
from tasks.train.anneal import AnnealConfig
from tasks.scaling.fit import FitConfig
from tasks.scaling.mix import MixConfig
from tasks.scaling.sweep import SweepConfig
from tasks.scaling.validate import ValidateConfig
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from tasks.train.planner import ClusterSpec


class StoreConfig(Section):
    """Where stage outputs live: `{root}/{stage}/{key}/`. Default: `{work_dir}/store`."""

    root: str | None = runtime_field(None)


class TrackingConfig(Section):
    """MLflow. Default URI: an SQLite file in the working directory (never the library default)."""

    uri: str | None = runtime_field(None)
    experiment: str = runtime_field("kiln")


class ClusterConfig(ClusterSpec):
    """How and where work is launched; never part of a key (it changes where work runs, not its result)."""

    executor: Literal["local", "slurm", "ray"] = runtime_field("local")
    launcher: Literal["local", "torchrun", "slurm", "kubernetes"] = runtime_field("local")


class TrainConfig(Section):
    """The production run. Its learning rate comes from the fit stage's plan unless `lr_override` is set.

    With `parallel` above one process the stage runs the distributed worker under torchrun (FSDP2 /
    DDP / TP / PP, sharded DCP checkpoints); its losses differ from one process's in the last float
    bits, so the layout is part of the key.
    """

    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    run: TrainRunConfig = TrainRunConfig()
    parallel: ParallelDims = ParallelDims()
    lr_override: float | None = None


class KilnConfig(Section):
    work_dir: str = runtime_field("kiln-work")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = runtime_field("WARNING")
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig = ClusterConfig()
    collect: CollectConfig = CollectConfig()
    clean: CleanConfig = CleanConfig()
    dedup: DedupConfig = DedupConfig()
    decontaminate: DecontaminateConfig = DecontaminateConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    sweep: SweepConfig = SweepConfig()
    fit: FitConfig = FitConfig()
    mix: MixConfig = MixConfig()
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    train: TrainConfig = TrainConfig()
    anneal: AnnealConfig = AnnealConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    continuous_eval: ContinuousEvalConfig = ContinuousEvalConfig()

    model_config = Section.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _check_mixture_domains(self) -> KilnConfig:
        for name, weights in self.sweep.mixtures.items():
            if not weights:
                raise ValueError(f"sweep.mixtures.{name} is empty: give at least one domain weight")
        return self

    @property
    def store_root(self) -> Path:
        return Path(self.store.root or Path(self.work_dir) / "store")

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{(Path(self.work_dir) / 'mlflow.db').resolve()}"

    @property
    def prefect_home(self) -> Path:
        return Path(self.work_dir) / "prefect"

    def section(self, name: str) -> Section:
        return getattr(self, "validate_" if name == "validate" else name)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


_CLI = "command line"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> KilnConfig:
    """Load `path` (following `extends:`), apply `key.sub=value` overrides, validate."""
    data: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is not None:
        data = _load_file(Path(path), origins, seen=())
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value)
        origins[key] = f"{_CLI} ({override})"
    try:
        return KilnConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_explain(error, origins)) from None


def _load_file(path: Path, origins: dict[str, str], seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (check the path; configs live in configs/)")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `extends` forms a cycle through {' -> '.join(map(str, seen))}")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the config as UTF-8") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(loaded).__name__}")
    base: dict[str, Any] = {}
    parent = loaded.pop("extends", None)
    if parent is not None:
        base = _load_file(path.parent / str(parent), origins, seen + (path.resolve(),))
    for key in _leaf_keys(loaded):
        origins[key] = str(path)
    return _deep_merge(base, loaded)


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not of the form key.sub=value (e.g. train.optim.lr=3e-4)")
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
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
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
            what = f"{item['msg']} (got {item.get('input')!r})"
        lines.append(f"  {origin}: {key or '<top level>'}: {what}")
    return "\n".join(lines)


def _origin_of(key: str, origins: dict[str, str]) -> str:
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:end]))
        if origin:
            return origin
    return "defaults"
