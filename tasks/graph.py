"""The stage graph and its keys: which stage reads which, and what each stage's key hashes.

A key covers the stage's own config sections (runtime fields excluded), the keys of its
inputs, the content of any files it reads from outside the store, and a format version.
So changing a setting re-runs exactly the stages whose output it can change, and nothing
else; `tests/test_graph.py` states which changes move which keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config import KilnConfig
from tasks.configbase import Section
from tasks.data.collect import source_paths
from tasks.fingerprint import fingerprint_paths
from tasks.store import stage_key


@dataclass(frozen=True)
class StageSpec:
    name: str
    inputs: tuple[str, ...]
    sections: tuple[str, ...]
    version: int = 1
    resumable: bool = False  # keeps its partial folder across attempts (training checkpoints)
    description: str = ""


STAGES: tuple[StageSpec, ...] = (
    StageSpec("collect", (), ("collect",), description="read sources, check licences"),
    StageSpec("clean", ("collect",), ("clean",), description="language ID and Gopher quality rules (datatrove)"),
    StageSpec("dedup", ("clean",), ("dedup",), description="exact and MinHash near-duplicate removal"),
    StageSpec("decontaminate", ("dedup",), ("decontaminate", "evaluate.eval_files", "evaluate.extra_tasks"),
              description="remove training docs that overlap the eval suite"),
    StageSpec("tokenize", ("decontaminate",), ("tokenize",), description="train BPE, write token shards per domain"),
    StageSpec("sweep", ("tokenize",), ("sweep",), description="proxy runs over LR, mixture and width"),
    StageSpec("fit", ("sweep",), ("fit", "validate.model"),
              description="pick LR and mixture, fit the scaling law, predict"),
    StageSpec("mix", ("tokenize", "fit"), ("mix", "train.run"), description="write the mixture manifest"),
    StageSpec("validate", ("mix", "fit", "sweep"), ("validate",), description="mid-scale run vs the prediction (gate)"),
    # version 2: DCP checkpoints (version 1's torch.save checkpoints in a partial folder are not resumable)
    StageSpec("train", ("mix", "fit", "validate"), ("train",), version=2, resumable=True,
              description="production training"),
    StageSpec("anneal", ("train", "tokenize", "fit"), ("anneal",), version=2, resumable=True,
              description="LR decay to zero on high-quality data"),
    StageSpec("evaluate", ("anneal", "train", "tokenize", "decontaminate"), ("evaluate",), description="lm-eval on held-out text"),
)
STAGE_NAMES = tuple(spec.name for spec in STAGES)
SPECS = {spec.name: spec for spec in STAGES}


def config_value(cfg: KilnConfig, dotted: str) -> Any:
    """The config value at a dotted path such as `evaluate.eval_files` (a section or a field)."""
    parts = dotted.split(".")
    value: Any = cfg.section(parts[0])
    for part in parts[1:]:
        value = getattr(value, part)
    return value


def _lookup(cfg: KilnConfig, dotted: str) -> Any:
    value = config_value(cfg, dotted)
    return value.identity() if isinstance(value, Section) else value


def _external_files(name: str, cfg: KilnConfig) -> dict[str, str]:
    if name == "collect":
        return {"sources_sha256": fingerprint_paths(source_paths(cfg.collect))}
    if name == "clean" and cfg.clean.quality_model is not None:
        return {"quality_model_sha256": fingerprint_paths([Path(cfg.clean.quality_model)])}
    if name in ("decontaminate", "evaluate"):
        return {"eval_files_sha256": fingerprint_paths(Path(p) for p in cfg.evaluate.eval_files)}
    return {}


def stage_identity(name: str, cfg: KilnConfig) -> dict[str, Any]:
    spec = SPECS[name]
    identity = {section: _lookup(cfg, section) for section in spec.sections}
    identity.update(_external_files(name, cfg))
    return identity


def stage_keys(cfg: KilnConfig) -> dict[str, str]:
    """Every stage's key, computed from the config alone (no stage needs to have run)."""
    keys: dict[str, str] = {}
    for spec in STAGES:
        keys[spec.name] = stage_key(spec.name, stage_identity(spec.name, cfg),
                                    {i: keys[i] for i in spec.inputs}, spec.version)
    return keys


def downstream_of(name: str) -> list[str]:
    """`name` and every stage that (transitively) reads it, in pipeline order."""
    affected = {name}
    for spec in STAGES:
        if affected & set(spec.inputs):
            affected.add(spec.name)
    return [s for s in STAGE_NAMES if s in affected]
