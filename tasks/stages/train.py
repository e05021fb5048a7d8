"""Stage `train`: production training, in this process or under torchrun (FSDP2/DDP/TP/PP/CP, DCP
checkpoints, resume, loss-spike rollback, relaunch of a failed job)."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveFloat, model_validator

from tasks.configbase import Section
from tasks.stage import Stage, StageContext
from tasks.stages._training import plan_mixture, planned_lr, train_headline, train_stats
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from tasks.scaling.mix import MIXTURE_FILE


class TrainConfig(Section):
    """The production run.

    `lr: plan` (the default) takes the fit stage's learning rate; a number overrides it. `optim.lr`
    is therefore not a setting here (the key hashes `lr`, never an unused `optim.lr`). With
    `parallel` above one process (or `cluster.launcher: torchrun`) the stage runs under torchrun;
    its losses differ from one process's in the last float bits, so the layout is part of the key.
    """

    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    run: TrainRunConfig = TrainRunConfig()
    parallel: ParallelDims = ParallelDims()
    lr: Literal["plan"] | PositiveFloat = "plan"

    @model_validator(mode="after")
    def _lr_lives_in_train_lr(self) -> TrainConfig:
        if "lr" in self.optim.model_fields_set:
            raise ValueError("train.optim.lr is not used: the learning rate is train.lr "
                             "('plan' for the fit stage's choice, or a number)")
        return self

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]
        return identity


def run(ctx: StageContext) -> dict:
    from tasks.train.loop import train_model

    cfg = ctx.cfg
    lr = planned_lr(ctx)
    optim = cfg.train.optim.model_copy(update={"lr": lr})
    parallel = cfg.train.parallel
    if parallel.world_size > 1 or cfg.cluster.launcher == "torchrun":
        from tasks.launch.torchrun_stage import train_with_torchrun

        result = train_with_torchrun(cfg.train.model, optim, cfg.train.run, parallel, cfg.cluster,
                                     ctx.inputs["mix"] / MIXTURE_FILE, ctx.store.root, ctx.out_dir,
                                     on_metrics=ctx.recorder.metrics, on_event=ctx.recorder.event)
        restarts = sum(e["kind"] == "process_failure" for e in result.health_events)
        return train_stats(result, device=cfg.train.run.device, lr=lr, world_size=parallel.world_size,
                           num_restarts=restarts)
    result = train_model(cfg.train.model, optim, cfg.train.run, plan_mixture(ctx), ctx.out_dir,
                         on_metrics=ctx.recorder.metrics, on_event=ctx.recorder.event)
    return train_stats(result, device=cfg.train.run.device, lr=lr)


# version 2: DCP checkpoints (version 1's torch.save checkpoints in a partial folder are not resumable)
# version 3: the key hashes train.lr instead of the unused train.optim.lr
# version 4: train.parallel no longer holds activation_checkpointing (train.run does)
STAGE = Stage(
    name="train", description="production training", body=run, inputs=("mix", "fit", "validate"),
    config=TrainConfig, version=4, resumable=True, headline=train_headline,
)
