"""Anneal: the end of pretraining — decay the learning rate to zero on higher-quality data.

Continues from the production model's weights (or any kept train checkpoint, WSD style) with a
linear or 1-sqrt decay from a fraction of the planned learning rate down to exactly zero, on a
mixture shifted toward the domains the team trusts most (prose by default).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.configbase import Section, runtime_field
from tasks.train.config import OptimConfig, TrainRunConfig


class AnnealConfig(Section):
    steps: int = Field(60, gt=0)
    lr_fraction: float = Field(0.5, gt=0, le=1, description="starting LR as a fraction of the production LR")
    schedule: Literal["linear", "1-sqrt"] = Field(
        "linear", description="decay to exactly 0: linear, or 1-sqrt (lr0 * (1 - sqrt(t/T)), lower sooner)")
    mixture: dict[str, float] = Field(
        default_factory=lambda: {"prose": 0.5, "web": 0.2, "code": 0.15, "multilingual": 0.15},
        description="domain weights during annealing (normalised)",
    )
    # Checkpoints of the anneal run (continuous eval scores each: the anneal part of the ECG). None: the
    # train run's checkpoint_every and keep_every. An anneal is short, so its own cadence is usually finer.
    checkpoint_every: int | None = runtime_field(None, gt=0)
    keep_every: int | None = runtime_field(None, gt=0)  # anneal checkpoints at multiples of this are never pruned


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
