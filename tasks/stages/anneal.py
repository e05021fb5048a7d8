"""Stage `anneal`: from the trained weights or any kept train checkpoint (WSD style), decay the LR to
zero on a mixture shifted to high-quality data: chosen domains and the best documents by quality score.

`anneal_into` is the whole anneal; the anneal-ablation stage runs it once per candidate mixture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.errors import ConfigError
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._training import kept_train_steps, planned_lr, run_training, train_headline, train_stats
from kiln.tasks.stages.train import planned_run  # the plan may have chosen them (train.model: plan)
from kiln.tasks.train.anneal import AnnealConfig, anneal_settings
from kiln.tasks.train.checkpoint import checkpoint_dir
from kiln.tasks.train.config import ModelConfig

START_MODEL_DIR = "start_model"  # a train checkpoint's weights as a model folder (anneal.from_step)


@dataclass(frozen=True)
class StartModel:
    """The weights an anneal starts from: a model folder and which train step it holds."""

    model_dir: Path
    step: int
    is_final: bool  # the train stage's final model (its val loss is the anneal's "before")


def start_model(ctx: StageContext, from_step: int | None, where: str) -> StartModel:
    """The train stage's final model, or the kept checkpoint of `from_step` written as a model folder
    into the stage's folder; a step the train run did not keep is a ConfigError listing those it did."""
    train_dir = ctx.inputs["train"]
    if from_step is None:
        return StartModel(train_dir / "model", ctx.read_json("train", "metrics.json")["steps"], True)
    kept = kept_train_steps(train_dir)
    if from_step not in kept:
        raise ConfigError(f"{where}={from_step}: the train run kept no checkpoint of step {from_step}; it kept steps "
                          f"{kept} (train.run.keep_every keeps more), or null for its final model")
    from kiln.tasks.train.dcp import checkpoint_model, load_model_weights, read_train_state  # defers torch
    from kiln.tasks.train.model import Transformer, save_model  # defers torch

    checkpoint = checkpoint_dir(train_dir / "checkpoints", from_step)
    # the model as that step trained it: a long-context phase's rotary positions only from its first step on
    model_cfg = ModelConfig.model_validate(checkpoint_model(read_train_state(checkpoint)))
    vocab_size = ctx.read_json("tokenize", SHARDS_FILE)["vocab_size"]
    model = Transformer(model_cfg, vocab_size)
    load_model_weights(checkpoint, model)
    model_dir = ctx.out_dir / START_MODEL_DIR
    save_model(model, model_cfg, vocab_size, model_dir)
    return StartModel(model_dir, from_step, False)


def start_model_config(start: StartModel) -> ModelConfig:
    """The config saved with the start model (the final model's, or its checkpoint step's)."""
    from kiln.tasks.train.model import read_model_config  # defers torch

    return read_model_config(start.model_dir)[0]


def anneal_into(ctx: StageContext, cfg: AnnealConfig, start: StartModel, where: str) -> dict[str, Any]:
    """Anneal `start` with `cfg` into `ctx.out_dir` (its `model/`, checkpoints and metrics); its stats."""
    from kiln.tasks.train.anneal_data import anneal_mixture  # defers torch

    # what train trained: under train.model: plan, the plan's context and batch
    train_run = planned_run(ctx)[1] if ctx.cfg.train.model == "plan" else ctx.cfg.train.run
    optim, run_cfg = anneal_settings(cfg, ctx.cfg.train.optim, train_run, planned_lr(ctx))
    mixture, selections = anneal_mixture(ctx.read_json("tokenize", SHARDS_FILE), ctx.inputs["tokenize"], cfg.mixture,
                                         f"{where}.mixture", ctx.out_dir)
    result = run_training(ctx, start_model_config(start), optim, run_cfg, mixture, init_model_dir=start.model_dir)
    before = ctx.read_json("train", "metrics.json")["val_loss"] if start.is_final else None
    return train_stats(result, device=run_cfg.device, world_size=result.world_size, start_lr=optim.lr,
                       schedule=cfg.schedule, from_step=start.step, val_loss_before=before,
                       quality_selections=selections)


def run(ctx: StageContext) -> dict:
    return anneal_into(ctx, ctx.cfg.anneal, start_model(ctx, ctx.cfg.anneal.from_step, "anneal.from_step"), "anneal")


def headline(stats: dict[str, Any]) -> dict[str, Any]:
    before = stats["val_loss_before"]
    return {**train_headline(stats), "from_step": stats["from_step"],
            **({} if before is None else {"val_loss_before": round(before, 4)})}


# version 4: anneal.schedule, anneal.from_step and quality selections; stats name the start step
STAGE = Stage(
    name="anneal", description="LR decay to zero on high-quality data", body=run, inputs=("train", "tokenize", "fit"),
    config=AnnealConfig, version=4, resumable=True, headline=headline,
)
