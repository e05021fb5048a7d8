"""Stage `validate`: a mid-scale run with the plan's LR, held to the fit's prediction (the gate)."""

from __future__ import annotations

import json

from tasks.scaling.fit import PLAN_FILE, PLOT_FILE, plot_plan
from tasks.scaling.sweep import TRIALS_FILE, load_trials
from tasks.scaling.validate import REPORT_FILE, ValidateConfig, ValidationGateError, check_gate
from tasks.stage import Stage, StageContext
from tasks.stages._training import plan_mixture, run_training, train_headline, train_stats


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    plan = ctx.read_json("fit", PLAN_FILE)
    optim = cfg.sweep.optim.model_copy(update={"lr": plan["lr"]})
    result = run_training(ctx, cfg.validate_.model, optim, cfg.sweep.run, plan_mixture(ctx))
    predicted = plan["predictions"].get("validate")
    report = check_gate(result.val_loss, result.loss_curve, predicted)
    (ctx.out_dir / REPORT_FILE).write_text(json.dumps(report.as_dict(), indent=2))
    if predicted:
        plan["predictions"]["validate"]["observed"] = result.val_loss
        plot_plan(plan, load_trials(ctx.inputs["sweep"] / TRIALS_FILE), ctx.out_dir / PLOT_FILE)
    if cfg.validate_.enforce and not report.passed:
        raise ValidationGateError(report.describe())
    return train_stats(result, device=cfg.sweep.run.device, world_size=result.world_size, gate=report.as_dict(), gate_passed=report.passed)


STAGE = Stage(
    name="validate", description="mid-scale run vs the prediction (gate)", body=run, inputs=("mix", "fit", "sweep"),
    config=ValidateConfig, headline=train_headline,
)
