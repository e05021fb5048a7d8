"""Stage `fit`: the sweep's trials → the laws (L(N, D), IsoFLOP minima, LR and batch laws, mixture
regression) → the plan (`plan.json`): the mixture, and the validate and production runs with their
predicted losses and intervals; plots and a report for MLflow and Prefect.

The plan knows the data: each domain's unique tokens (tokenize's counts), the chosen mixture and
`mix.max_epochs`. Every prediction counts repeated tokens at their effective value (Muennighoff et
al. 2023, `tasks.scaling.plan`). For `fit.budget_flops` it plans the compute-optimal run and the
data-feasible one (never more epochs of any domain than `mix.max_epochs`) side by side; the latter
is `runs.production`, what `train.model: plan` trains. The train stage predicts its own loss from the
same law, whatever shape it trains.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.scaling import plots
from kiln.tasks.scaling.fit import (
    PLAN_FILE,
    REPORT_FILE,
    FitConfig,
    chosen_mixture,
    excluded,
    fit_laws,
    fit_mixture,
    hyper_grid,
    loss_law_to_dict,
)
from kiln.tasks.scaling.plan import (
    DataBudget,
    describe,
    plan_data_feasible,
    plan_for_compute,
    plan_for_model,
    unique_tokens,
)
from kiln.tasks.scaling.sweep import TRIALS_FILE, load_trials, normalised
from kiln.tasks.stage import Stage, StageContext


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    sweep = cfg.sweep
    trials = load_trials(ctx.inputs["sweep"] / TRIALS_FILE)
    vocab_size = ctx.read_json("tokenize", SHARDS_FILE)["vocab_size"]
    laws = fit_laws(cfg.fit, sweep, trials)
    law, isoflop, hyper = laws["loss_law"], laws["isoflop"], laws["hyper"]
    mixture = fit_mixture(cfg.fit, sweep, trials)
    chosen = chosen_mixture(mixture)

    data = DataBudget(unique_tokens(ctx.read_json("tokenize", SHARDS_FILE)), normalised(chosen["weights"]),
                      cfg.mix.max_epochs)
    compute = cfg.fit.budget_flops
    refused = dict(laws["refused"])
    validate_run = cfg.validate_.run
    runs: dict[str, Any] = {"validate": plan_for_model(
        cfg.validate_.model, validate_run.steps * validate_run.batch_size * validate_run.seq_len,
        validate_run.batch_size, validate_run.seq_len, sweep, vocab_size, law, hyper, trials, data)}
    if compute is None:
        refused["production"] = "fit.budget_flops is null: no production budget to plan for"
    else:
        try:
            runs["compute_optimal"] = plan_for_compute(compute, sweep, vocab_size, law, isoflop, hyper, trials, data)
            runs["production"] = plan_data_feasible(compute, sweep, vocab_size, law, hyper, trials, data,
                                                    runs["compute_optimal"])
        except ValueError as error:
            refused["production"] = str(error)
    lr_run = runs.get("production") or runs["validate"]
    warnings = [*(law.warnings if law else ()), *(isoflop.warnings if isoflop else ()),
                *(hyper.warnings if hyper else ())]
    if mixture["recommendation"]:
        warnings += mixture["recommendation"]["warnings"]
    plan = {
        "format": 3,
        "lr": lr_run["lr"],  # the production LR: what `train.lr: plan` takes
        "mixture": chosen,
        "reference_mixture": {"name": sweep.reference, "weights": normalised(sweep.mixtures[sweep.reference])},
        "production_compute": compute,
        "data": data.as_dict(),
        "runs": runs,
        "loss_law": loss_law_to_dict(law) if law else None,
        "isoflop": isoflop.as_dict() if isoflop else None,
        "hyperparameter_laws": hyper.as_dict() if hyper else None,
        "mixture_regression": mixture,
        "points": laws["points"],
        "family": {"model": sweep.model.model_dump(mode="json"), "seq_len": sweep.run.seq_len,
                   "batch_size": sweep.run.batch_size, "vocab_size": vocab_size},
        "refused": refused,
        "warnings": warnings,
        "excluded_trials": excluded(trials),
    }
    (ctx.out_dir / PLAN_FILE).write_text(json.dumps(plan, indent=2))
    write_plots(ctx, plan, trials, laws, mixture)
    return {"plan_summary": summary(plan), "num_points": len(laws["points"]), "refused": sorted(refused),
            **law_stats(plan)}


def law_stats(plan: dict[str, Any]) -> dict[str, Any]:
    """The numbers MLflow should chart across runs (flat floats)."""
    out: dict[str, Any] = {}
    law = plan["loss_law"]
    if law:
        for name in ("E", "A", "B", "alpha", "beta"):
            out[f"law.{name}"] = law[name]
            out[f"law.{name}_low"], out[f"law.{name}_high"] = law["intervals"][name]
        out["law.rmse_log"] = law["rmse_log"]
        if law["heldout_rmse_log"] is not None:
            out["law.heldout_rmse_log"] = law["heldout_rmse_log"]
    mixture = plan["mixture_regression"]
    if mixture.get("heldout_spearman") is not None:
        out["mixture.heldout_spearman"] = mixture["heldout_spearman"]
    for name, run in plan["runs"].items():
        if run.get("predicted_loss") is not None:
            out[f"{name}.predicted_loss"] = run["predicted_loss"]
            out[f"{name}.interval_low"], out[f"{name}.interval_high"] = run["interval"]
        if "data" in run:
            out[f"{name}.max_epochs"] = run["data"]["max_epochs"]
            out[f"{name}.effective_tokens"] = run["data"]["effective_tokens"]
    return out


def summary(plan: dict[str, Any]) -> str:
    lines = []
    law = plan["loss_law"]
    if law:
        iv = law["intervals"]
        lines.append(f"L(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.3f} + {law['B']:.4g}/D^{law['beta']:.3f}"
                     f" ({law['num_points']} points, RMSE(log) {law['rmse_log']:.4f})")
        lines.append("  " + ", ".join(f"{k} [{iv[k][0]:.3g}, {iv[k][1]:.3g}]" for k in ("E", "A", "B", "alpha", "beta"))
                     + f" ({law['level']:.0%} bootstrap)")
    for name, reason in plan["refused"].items():
        lines.append(f"refused {name}: {reason}")
    for name, run in plan["runs"].items():
        lines.append(describe(run, {"production": "production (data-feasible)"}.get(name, name)))
    mix = plan["mixture"]
    regression = plan["mixture_regression"]
    rho = regression.get("heldout_spearman")
    lines.append(f"mixture {mix['name']} ({mix['source']}"
                 + (f", held-out Spearman {rho:.2f}" if rho is not None else "") + "): "
                 + ", ".join(f"{d} {w:.2f}" for d, w in mix["weights"].items()))
    return "\n".join(lines)


def write_plots(ctx: StageContext, plan: dict[str, Any], trials: list, laws: dict[str, Any],
                mixture: dict[str, Any]) -> None:
    """The four plots (top-level PNGs: the runner logs them to MLflow) and `report.md` (Prefect)."""
    import numpy as np


    out = ctx.out_dir
    plots.plot_isoflop(laws["points"], laws["isoflop"], laws["loss_law"], out / plots.ISOFLOP_PLOT)
    plots.plot_law(laws["points"], laws["loss_law"], plan["runs"], out / plots.LAW_PLOT)
    plots.plot_hyperparameters(hyper_grid(ctx.cfg.sweep, trials), laws["hyper"], out / plots.HYPER_PLOT)
    shown = [plots.ISOFLOP_PLOT, plots.LAW_PLOT, plots.HYPER_PLOT]
    if mixture["num_trials"]:
        from kiln.tasks.scaling.mixture_regression import fit_mixture_regression  # defers sklearn

        domains = mixture["domains"]
        runs = [t for t in trials if t.ok and t.kind == "mixture"]
        weights = np.array([[t.weights.get(d, 0.0) for d in domains] for t in runs])
        targets = [t.val_loss if mixture["target"] == "average" else t.val_loss_by_domain[mixture["target"]]
                   for t in runs]
        fit = None
        if mixture["chosen"]:  # refit the chosen model (deterministic: same seed, same folds) to draw it
            fit = fit_mixture_regression(weights, targets, domains=domains, model=mixture["chosen"],
                                         num_folds=ctx.cfg.fit.mixture_folds)
        reference = plan["reference_mixture"]["weights"]
        plots.plot_mixture(mixture, fit, reference, weights, targets, out / plots.MIXTURE_PLOT)
        shown.append(plots.MIXTURE_PLOT)
    body = ["# Kiln fit: laws and plan", "", "```", plan_summary_text(plan), "```", ""]
    body += [plots.inline_image(out / name, name) for name in shown]
    (out / REPORT_FILE).write_text("\n\n".join(body) + "\n")


def plan_summary_text(plan: dict[str, Any]) -> str:
    warnings = "\n".join(f"warning: {w}" for w in plan["warnings"])
    return summary(plan) + ("\n" + warnings if warnings else "")


def headline(stats: dict) -> dict:
    out: dict[str, Any] = {}
    if "law.alpha" in stats:
        out["alpha"] = round(stats["law.alpha"], 3)
        out["beta"] = round(stats["law.beta"], 3)
    if "validate.predicted_loss" in stats:
        out["validate_pred"] = round(stats["validate.predicted_loss"], 4)
    if "production.predicted_loss" in stats:
        out["production_pred"] = round(stats["production.predicted_loss"], 4)
        out["production_epochs"] = round(stats["production.max_epochs"], 2)
    if "mixture.heldout_spearman" in stats:
        out["mix_spearman"] = round(stats["mixture.heldout_spearman"], 2)
    if stats["refused"]:
        out["refused"] = ",".join(stats["refused"])
    return out


STAGE = Stage(
    name="fit", description="scaling laws, LR/batch laws, mixture regression, the plan", body=run,
    inputs=("sweep", "tokenize"), config=FitConfig,
    reads=("validate.model", "validate.run", "mix.max_epochs"), headline=headline,
    # 3: the mixture regression's predictions for its optimum and each mixture trial (validate's transfer check)
    # 4: prediction intervals scale the residuals up to the held-out (extrapolation) RMSE when that is larger
    # 5: predictions on effective data D' (repeated tokens, Muennighoff et al. 2023); the production run is the
    #    data-feasible one (mix.max_epochs), the compute-optimal one beside it
    reports=(REPORT_FILE,), version=5,
)
