"""Stage `sweep`: the proxy runs (IsoFLOP grid, LR x batch grid, mixture design); each trial is a child MLflow run.

Resumable: each trial's result is kept in the partial folder as it finishes (`trials/<name>.json`),
so a crashed or interrupted attempt's retry runs only the trials without one. A diverged or failed
trial is a result too (its child run is marked failed, with the reason); the stage fails only when
no trial finished.
"""

from __future__ import annotations

from tasks.data.tokenize import SHARDS_FILE
from tasks.scaling.sweep import TrialResult, SweepConfig, run_sweep, succeeded
from tasks.stage import Stage, StageContext

REASON_TAG_CHARS = 1000  # MLflow caps tag values; the whole reason is in trials.json


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg.sweep
    tracker, parent = ctx.recorder.tracker, ctx.recorder.run_id

    def record_trial(trial: TrialResult, resumed: bool) -> None:
        tags = {"kiln.stage": "sweep-trial", "kiln.trial.status": trial.status}
        if trial.reason:
            tags["kiln.trial.reason"] = trial.reason[:REASON_TAG_CHARS]
        if resumed:
            tags["kiln.trial.resumed"] = "true"  # finished by an earlier attempt of this stage
        run_id = tracker.start_run(trial.name, parent_id=parent, tags={**tags, "kiln.trial.kind": trial.kind}, params={
            "lr": trial.lr, "width": trial.width, "mixture": trial.mixture, "batch_size": trial.batch_size,
            "num_params": trial.num_params, "tokens": trial.tokens, **({"budget": trial.budget} if trial.budget else {}),
            **{f"weight.{d}": w for d, w in trial.weights.items()}})
        # the curve at the training loop's logging cadence (and its last step): a few calls per trial
        curve = trial.loss_curve
        for step, loss in curve:
            if step % cfg.run.log_every == 0 or step == curve[-1][0]:
                tracker.log_metrics(run_id, {"train.loss": loss}, step)
        final = {"steps": trial.steps, "tokens_seen": trial.tokens_seen, "wall_s": trial.wall_s}
        if trial.ok:
            final |= {"val_loss": trial.val_loss, "final_train_loss": trial.final_train_loss,
                      **{f"val_loss.{d}": v for d, v in trial.val_loss_by_domain.items()}}
        tracker.log_metrics(run_id, final)
        tracker.end_run(run_id, failed=not trial.ok)

    tokenized = ctx.inputs["tokenize"]
    results = run_sweep(cfg, ctx.read_json("tokenize", SHARDS_FILE), tokenized, ctx.out_dir, record_trial)
    finished = succeeded(results)
    best = min(finished, key=lambda r: r.val_loss)
    return {"num_trials": len(results), "num_ok": len(finished),
            "num_by_kind": {k: sum(r.kind == k for r in results) for k in ("isoflop", "hyper", "mixture")},
            "num_diverged": sum(r.status == "diverged" for r in results),
            "num_failed": sum(r.status == "failed" for r in results),
            "best_trial": best.name, "best_val_loss": best.val_loss,
            "trial_val_loss": {r.name: r.val_loss for r in finished},
            "excluded_trials": {r.name: f"{r.status} at step {r.steps}: {r.reason}" for r in results if not r.ok}}


def headline(stats: dict) -> dict:
    out = {"trials": stats["num_trials"], "best": stats["best_trial"],
           "best_val_loss": round(stats["best_val_loss"], 4)}
    if stats["num_ok"] < stats["num_trials"]:
        out["not_finished"] = stats["num_trials"] - stats["num_ok"]
    return out


STAGE = Stage(
    name="sweep", description="proxy runs: IsoFLOP grid, LR x batch grid, mixture design", body=run,
    inputs=("tokenize",),
    # 2: the key no longer hashes the unused sweep.optim.lr; 3: failed trials are results (status,
    # reason, steps, curve), trials are named with their batch size, one result file per trial;
    # 4: IsoFLOP, LR x batch and Dirichlet mixture designs
    config=SweepConfig, version=4, resumable=True, headline=headline,
)
