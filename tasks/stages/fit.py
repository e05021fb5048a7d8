"""Stage `fit`: pick the LR and mixture, fit the scaling law, predict the validate run's loss (the plan).

Uses the sweep's finished trials only; refuses (`NotEnoughTrialsError`) when failures left too few.
"""

from __future__ import annotations

import json

from tasks.scaling.fit import PLAN_FILE, PLOT_FILE, FitConfig, fit_plan, plot_plan
from tasks.scaling.sweep import TRIALS_FILE, load_trials
from tasks.stage import Stage, StageContext


def run(ctx: StageContext) -> dict:
    from tasks.train.model import count_parameters

    cfg = ctx.cfg
    trials = load_trials(ctx.inputs["sweep"] / TRIALS_FILE)
    targets = {"validate": count_parameters(cfg.validate_.model, 0)}  # non-embedding N, as the sweep's points
    plan = fit_plan(cfg.fit, trials, cfg.sweep.model.d_model, cfg.sweep.mixtures, targets, cfg.sweep.run.batch_size)
    (ctx.out_dir / PLAN_FILE).write_text(json.dumps(plan, indent=2))
    plot_plan(plan, trials, ctx.out_dir / PLOT_FILE)
    return {"plan": plan}


def headline(stats: dict) -> dict:
    plan = stats["plan"]
    out = {"lr": plan["lr"], "mixture": plan["mixture"]["name"]}
    if plan["predictions"]:
        out["predicted_val_loss"] = round(plan["predictions"]["validate"]["loss"], 4)
    return out


STAGE = Stage(
    name="fit", description="pick LR and mixture, fit the scaling law, predict", body=run, inputs=("sweep",),
    config=FitConfig, reads=("validate.model",), headline=headline,
)
