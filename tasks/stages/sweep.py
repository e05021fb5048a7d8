"""Stage `sweep`: the proxy runs over learning rate, mixture and width; each trial is a child MLflow run."""

from __future__ import annotations

from tasks.data.tokenize import SHARDS_FILE
from tasks.scaling.sweep import SweepConfig, TrialResult, run_sweep
from tasks.stage import Stage, StageContext


def run(ctx: StageContext) -> dict:
    def record_trial(trial: TrialResult) -> None:
        ctx.recorder.child_run(
            trial.name, stage="sweep-trial",
            params={"lr": trial.lr, "width": trial.width, "mixture": trial.mixture, "num_params": trial.num_params},
            metrics={"val_loss": trial.val_loss, "final_train_loss": trial.final_train_loss,
                     "tokens_seen": trial.tokens_seen, "wall_s": trial.wall_s,
                     **{f"val_loss.{d}": v for d, v in trial.val_loss_by_domain.items()}})

    tokenized = ctx.inputs["tokenize"]
    results = run_sweep(ctx.cfg.sweep, ctx.read_json("tokenize", SHARDS_FILE), tokenized, ctx.out_dir, record_trial)
    best = min(results, key=lambda r: r.val_loss)
    return {"num_trials": len(results), "best_trial": best.name, "best_val_loss": best.val_loss,
            "trial_val_loss": {r.name: r.val_loss for r in results}}


STAGE = Stage(
    name="sweep", description="proxy runs over LR, mixture and width", body=run, inputs=("tokenize",),
    config=SweepConfig, version=2,  # 2: the key no longer hashes the unused sweep.optim.lr
    headline=lambda s: {"trials": s["num_trials"], "best": s["best_trial"], "best_val_loss": round(s["best_val_loss"], 4)},
)
