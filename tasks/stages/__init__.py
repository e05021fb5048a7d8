"""Kiln's stages, in pipeline order. Adding a stage: a module in this package declaring `STAGE`, imported
here and listed in `STAGE_MODULES` (after the stages it reads)."""

from kiln.tasks.stage import Registry
from kiln.tasks.stages import (
    anneal,
    anneal_ablation,
    batch,
    clean,
    collect,
    decontaminate,
    dedup,
    dedup_batch,
    evaluate,
    export,
    fit,
    mix,
    research,
    sweep,
    tokenize,
    train,
    validate,
)

STAGE_MODULES = (collect, clean, dedup, decontaminate, tokenize, sweep, fit, mix, validate, train, anneal,
                 anneal_ablation, evaluate, export, dedup_batch, batch, research)

REGISTRY = Registry([module.STAGE for module in STAGE_MODULES])


def registry_or_default(registry: Registry | None) -> Registry:
    """`registry`, else `REGISTRY` as this module holds it now: read at each call, not bound at import,
    so a caller that swaps the module's registry (a test's stages, an embedding tool's) is obeyed
    by config loading, keys and the runner alike."""
    return REGISTRY if registry is None else registry
