"""Stage `anneal`: from the trained weights, decay the LR to zero on a mixture shifted to high-quality data."""

from __future__ import annotations

from tasks.data.tokenize import SHARDS_FILE
from tasks.stage import Stage, StageContext
from tasks.stages._training import planned_lr, run_training, train_headline, train_stats
from tasks.stages.train import trained_model_config  # the plan may have chosen it (train.model: plan)
from tasks.train.anneal import AnnealConfig, anneal_settings


def run(ctx: StageContext) -> dict:
    from tasks.train.data_loader import mixture_with_weights

    cfg = ctx.cfg
    optim, run_cfg = anneal_settings(cfg.anneal, cfg.train.optim, cfg.train.run, planned_lr(ctx))
    mixture = mixture_with_weights(ctx.read_json("tokenize", SHARDS_FILE), ctx.inputs["tokenize"],
                                   cfg.anneal.mixture, "anneal.mixture")
    result = run_training(ctx, trained_model_config(ctx), optim, run_cfg, mixture,
                          init_model_dir=ctx.inputs["train"] / "model")
    before = ctx.read_json("train", "metrics.json")["val_loss"]
    return train_stats(result, device=run_cfg.device, world_size=result.world_size, start_lr=optim.lr,
                       val_loss_before=before)


STAGE = Stage(
    name="anneal", description="LR decay to zero on high-quality data", body=run, inputs=("train", "tokenize", "fit"),
    config=AnnealConfig, version=3, resumable=True,
    headline=lambda s: {**train_headline(s), "val_loss_before": round(s["val_loss_before"], 4)},
)
