"""What the training stages (validate, train, anneal) share: the planned learning rate, the plan's
mixture, and how a `TrainResult` becomes stage stats."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tasks.scaling.fit import PLAN_FILE
from tasks.scaling.mix import MIXTURE_FILE
from tasks.stage import StageContext

if TYPE_CHECKING:  # torch-backed: stage modules import training code in their bodies, so that the
    # config tree, keys and cached reruns never load torch
    from tasks.train.data_loader import Mixture
    from tasks.train.loop import TrainResult


def planned_lr(ctx: StageContext) -> float:
    """`train.lr`: the fit stage's LR when it says `plan`, else the number it gives."""
    lr = ctx.cfg.train.lr
    return ctx.read_json("fit", PLAN_FILE)["lr"] if lr == "plan" else float(lr)


def plan_mixture(ctx: StageContext) -> Mixture:
    from tasks.train.data_loader import Mixture

    return Mixture.from_manifest(ctx.inputs["mix"] / MIXTURE_FILE, ctx.store.root)


def train_stats(result: TrainResult, *, device: str, world_size: int = 1, **extra: Any) -> dict[str, Any]:
    """The stage stats of a training run; `num_accelerators` (0 on CPU) prices its accelerator-seconds."""
    return {"num_accelerators": world_size if device != "cpu" else 0, "world_size": world_size, "steps": result.steps, "tokens_seen": result.tokens_seen, "num_params": result.num_params,
            "final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
            "val_loss_by_domain": result.val_loss_by_domain, "tokens_per_s": result.tokens_per_s,
            "resumed_from_step": result.resumed_from_step, "num_rollbacks": result.num_rollbacks, **extra}


def train_headline(stats: dict[str, Any]) -> dict[str, Any]:
    return {"steps": stats["steps"], "tokens": stats["tokens_seen"], "params": stats["num_params"],
            "train_loss": round(stats["final_train_loss"], 4), "val_loss": round(stats["val_loss"], 4)}
