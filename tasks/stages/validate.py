"""Stage `validate`: a mid-scale run with the plan's LR and mixture, held to the fit's bootstrap
prediction interval (the gate). It records the gate report (`gate.json`, and the law plot with
the observed point); the train stage is the one that refuses to start on a failed gate."""

from __future__ import annotations

import json

from tasks.scaling.fit import PLAN_FILE, loss_law_from_dict
from tasks.scaling.validate import REPORT_FILE, ValidateConfig, check_gate
from tasks.stage import Stage, StageContext
from tasks.stages._training import plan_mixture, run_training, train_headline, train_stats


def run(ctx: StageContext) -> dict:
    from tasks.scaling import plots

    cfg = ctx.cfg
    plan = ctx.read_json("fit", PLAN_FILE)
    planned = plan["runs"]["validate"]
    optim = cfg.sweep.optim.model_copy(update={"lr": planned["lr"]})
    result = run_training(ctx, cfg.validate_.model, optim, cfg.validate_.run, plan_mixture(ctx))
    predicted = None
    if planned["predicted_loss"] is not None:
        low, high = planned["interval"]
        predicted = {"loss": planned["predicted_loss"], "low": low, "high": high, "level": planned["level"],
                     "num_params": planned["num_params"], "tokens": planned["tokens"]}
    report = check_gate(result.val_loss, result.loss_curve, predicted, health_events=result.health_events,
                        grad_norm_curve=result.grad_norm_curve, warmup_steps=optim.warmup_steps, cfg=cfg.validate_)
    (ctx.out_dir / REPORT_FILE).write_text(json.dumps(report.as_dict(), indent=2))
    law = loss_law_from_dict(plan["loss_law"]) if plan["loss_law"] else None
    plots.plot_law(plan["points"], law, plan["runs"], ctx.out_dir / plots.LAW_PLOT,
                   observed={"validate": result.val_loss})
    (ctx.out_dir / "gate.md").write_text(f"# Kiln validation gate\n\n```\n{report.describe()}\n```\n\n"
                                         + plots.inline_image(ctx.out_dir / plots.LAW_PLOT, "law") + "\n")
    stats = train_stats(result, device=cfg.validate_.run.device, world_size=result.world_size, lr=planned["lr"],
                        gate=report.as_dict(), gate_passed=report.passed)
    if predicted:
        stats |= {"predicted_val_loss": predicted["loss"], "interval_low": predicted["low"],
                  "interval_high": predicted["high"]}
    return stats


def headline(stats: dict) -> dict:
    out = {**train_headline(stats), "gate": "passed" if stats["gate_passed"] else "FAILED"}
    if "predicted_val_loss" in stats:
        out["interval"] = f"[{stats['interval_low']:.4f}, {stats['interval_high']:.4f}]"
    return out


# version 2: the gate's interval is the fit's bootstrap prediction interval (no floor); validate.run;
# a failed gate is recorded here and enforced by the train stage
STAGE = Stage(
    name="validate", description="mid-scale run vs the prediction (gate)", body=run, inputs=("mix", "fit"),
    config=ValidateConfig, headline=headline, version=2, reports=("gate.md",),
)
