"""Stage `train`: production training, in this process or under torchrun (FSDP2/DDP/TP/PP/CP, DCP
checkpoints, resume, loss-spike rollback, relaunch of a failed job)."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveFloat, model_validator

from tasks.configbase import Section, runtime_field
from tasks.stage import Stage, StageContext
from tasks.stages._training import plan_mixture, planned_lr, run_training, train_headline, train_stats
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig


class TrainConfig(Section):
    """The production run.

    `lr: plan` (the default) takes the fit stage's learning rate; a number overrides it. `optim.lr`
    is therefore not a setting here (the key hashes `lr`, never an unused `optim.lr`). `parallel` is
    the layout (dp x tp x pp x cp), or `auto` for the planner's choice on `cluster`; like
    `run.grad_accum` it is runtime: the global batch (`run.batch_size`) is what the key holds, so a
    run stopped under one layout resumes under another. Above one process (or with a `torchrun`,
    `slurm` or `kubernetes` launcher) the stage runs through `cluster.launcher`.
    """

    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    run: TrainRunConfig = TrainRunConfig()
    parallel: ParallelDims | Literal["auto"] = runtime_field(ParallelDims())
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
    cfg = ctx.cfg
    lr = planned_lr(ctx)
    optim = cfg.train.optim.model_copy(update={"lr": lr})
    result = run_training(ctx, cfg.train.model, optim, cfg.train.run, plan_mixture(ctx))
    restarts = sum(e["kind"] == "process_failure" for e in result.health_events)
    return train_stats(result, device=cfg.train.run.device, lr=lr, world_size=result.world_size,
                       num_restarts=restarts)


# version 2: DCP checkpoints (version 1's torch.save checkpoints in a partial folder are not resumable)
# version 3: the key hashes train.lr instead of the unused train.optim.lr
# version 4: train.parallel no longer holds activation_checkpointing (train.run does)
# version 5: train.run.batch_size is the global batch; the layout and grad_accum left the key
STAGE = Stage(
    name="train", description="production training", body=run, inputs=("mix", "fit", "validate"),
    config=TrainConfig, version=5, resumable=True, headline=train_headline,
)
