"""Anneal: the end of pretraining — decay the learning rate to zero on higher-quality data.

Continues from the production model's weights (or any kept train checkpoint, WSD style) with a
linear or 1-sqrt decay from a fraction of the planned learning rate down to exactly zero, on a
mixture shifted toward the domains the team trusts most (prose by default).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from kiln.tasks.configbase import Reference, Section, runtime_field
from kiln.tasks.train.config import OptimConfig, TrainRunConfig


class QualitySelection(Section):
    """A mixture entry drawing the best documents by the clean stage's `quality_score`: the top
    `quality_top` share of the scored train documents of `domains`, ranked together (documents
    tied with the last one in are in too). Documents without a score (the classifier judged none,
    or never saw their domain) are never selected; the stage stats count them per domain."""

    quality_top: float = Field(gt=0, le=1, description="share of the scored documents taken, best first (0.2: the top fifth)")
    weight: float = Field(gt=0, description="sampling weight beside the mixture's domain weights (all normalised together)")
    domains: list[str] | None = Field(None, description="domains whose documents compete; None: every domain with scores")


# A mixture: domain -> weight, or a name of your choice -> a QualitySelection (e.g. {best: {quality_top: 0.2, weight: 0.5}}).
AnnealMixture = dict[str, float | QualitySelection]


def mixture_references(key: str, mixture: AnnealMixture) -> list[Reference]:
    """The domains an anneal mixture at `key` names: its weighted keys and its selections' `domains`."""
    weighted = tuple(name for name, entry in mixture.items() if not isinstance(entry, QualitySelection))
    return [Reference(key, "domain", weighted, keyed=True)] + [
        Reference(f"{key}.{name}.domains", "domain", tuple(entry.domains)) for name, entry in mixture.items()
        if isinstance(entry, QualitySelection) and entry.domains is not None]


class AnnealConfig(Section):
    steps: int = Field(60, gt=0)
    lr_fraction: float = Field(0.5, gt=0, le=1, description="starting LR as a fraction of the production LR")
    schedule: Literal["linear", "1-sqrt"] = Field(
        "linear", description="decay to exactly 0: linear, or 1-sqrt (lr0 * (1 - sqrt(t/T)), lower sooner)")
    mixture: AnnealMixture = Field(
        default_factory=lambda: {"prose": 0.5, "web": 0.2, "code": 0.15, "multilingual": 0.15},
        description="domain weights during annealing, and quality selections (a name -> {quality_top, weight, "
                    "domains}: the best documents by the clean stage's quality_score); weights normalised together",
    )
    from_step: int | None = Field(None, ge=0, description="start from this kept train checkpoint (train.run.keep_every "
                                                         "keeps more); None: the train stage's final model")
    # Checkpoints of the anneal run (continuous eval scores each: the anneal part of the ECG). None: the
    # train run's checkpoint_every and keep_every. An anneal is short, so its own cadence is usually finer.
    checkpoint_every: int | None = runtime_field(None, gt=0)
    keep_every: int | None = runtime_field(None, gt=0)  # anneal checkpoints at multiples of this are never pruned

    def names_used(self) -> list[Reference]:
        return super().names_used() + mixture_references("mixture", self.mixture)


def anneal_settings(cfg: AnnealConfig, optim: OptimConfig, run: TrainRunConfig, lr: float) -> tuple[OptimConfig, TrainRunConfig]:
    """The optimizer and run budget of the anneal phase, derived from the production run's."""
    anneal_optim = optim.model_copy(update={
        "lr": lr * cfg.lr_fraction, "schedule": cfg.schedule, "warmup_steps": 0, "min_lr_ratio": 0.0,
    })
    anneal_run = run.model_copy(update={"steps": cfg.steps, "seed": run.seed + 1, **anneal_checkpointing(cfg, run)})
    return anneal_optim, anneal_run


def anneal_checkpointing(cfg: AnnealConfig, run: TrainRunConfig) -> dict[str, int | None]:
    """The anneal run's checkpoint cadence and the checkpoints it keeps (continuous eval reads the same)."""
    return {"checkpoint_every": cfg.checkpoint_every or run.checkpoint_every,
            "keep_every": cfg.keep_every or run.keep_every}


class AnnealAblationConfig(Section):
    """Short anneals from one train checkpoint, one per candidate mixture, each scored by the evaluate
    suite: the cheap way to judge a new data source (OLMo, Llama 3). No candidates: the stage says so
    and does nothing."""

    candidates: dict[str, AnnealMixture] = Field(
        default_factory=dict, description="name -> an anneal mixture (domains and quality selections, as anneal.mixture)")
    steps: int = Field(20, gt=0, description="steps of each candidate's anneal")
    from_step: int | None = Field(None, ge=0, description="the kept train checkpoint every candidate starts from; "
                                                         "None: the train stage's final model")
    lr_fraction: float = Field(0.5, gt=0, le=1, description="starting LR as a fraction of the production LR")
    schedule: Literal["linear", "1-sqrt"] = "1-sqrt"

    @field_validator("candidates")
    @classmethod
    def _names_are_folder_names(cls, candidates: dict[str, AnnealMixture]) -> dict[str, AnnealMixture]:
        bad = [name for name in candidates
               if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith(".") or name == "start"]
        if bad:
            raise ValueError(f"candidate names {bad} must be letters, digits, '_', '-' or '.' (they name folders), "
                             "and not 'start' (the report's name for the model every candidate starts from)")
        return candidates

    def names_used(self) -> list[Reference]:
        return super().names_used() + [ref for name, mixture in self.candidates.items()
                                       for ref in mixture_references(f"candidates.{name}", mixture)]

    def anneal_config(self, mixture: AnnealMixture) -> AnnealConfig:
        """The anneal one candidate runs."""
        return AnnealConfig(steps=self.steps, lr_fraction=self.lr_fraction, schedule=self.schedule, mixture=mixture,
                            from_step=self.from_step)
