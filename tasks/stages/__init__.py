"""Kiln's stages, in pipeline order. Adding a stage: a module in this package declaring `STAGE`, and
its name in `STAGE_MODULES` (after the stages it reads)."""

from importlib import import_module

from kiln.tasks.stage import Registry

STAGE_MODULES = (
    "collect", "clean", "dedup", "decontaminate", "tokenize", "sweep", "fit", "mix", "validate", "train", "anneal",
    "anneal_ablation", "evaluate", "export",
    "dedup_batch",
)

REGISTRY = Registry([import_module(f"kiln.tasks.stages.{name}").STAGE for name in STAGE_MODULES])
