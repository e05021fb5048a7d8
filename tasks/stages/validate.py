"""Stage `validate`: a mid-scale run with the plan's LR and mixture, and the gate on it. Beside it,
a few of the fit's mixtures, the reference among them, are trained at this size to check that
the mixture regression's ranking transfers. The run on the reference mixture (the law's and the
proxies') is the one held to the fit's bootstrap prediction interval and, with the sweep's best
proxy per budget, scored on the eval suite (capabilities against compute). It records the
gate report (`gate.json`, `gate.md`, the law plot with the observed point, `capabilities.png`);
the train stage is the one that refuses to start on a failed gate. Each transfer run is a sub-run
(`transfer/<mixture>/`: its manifest and MLflow child run), trained where the validate run trains."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.errors import TrainingDivergedError
from kiln.tasks.evals.categories import SuiteConfig
from kiln.tasks.evals.evaluate import RESULTS_FILE, check_wanted_tasks, evaluate_model, suite_task_names
from kiln.tasks.ledger import SubRun
from kiln.tasks.scaling import plots
from kiln.tasks.evals.trust import decision_accuracy_by_key
from kiln.tasks.scaling.capabilities import ScoredModel, capability_items, capability_trend, primary_metrics
from kiln.tasks.scaling.fit import PLAN_FILE, loss_law_from_dict
from kiln.tasks.scaling.sweep import TRIALS_DIR, TRIALS_FILE, best_isoflop_trials, load_trials
from kiln.tasks.scaling.transfer import choose_transfer_mixtures, transfer_spearman
from kiln.tasks.scaling.validate import REPORT_FILE, ValidateConfig, check_gate
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import configured_eval_files
from kiln.tasks.stages._training import (
    plan_mixture,
    run_training,
    train_headline,
    train_stats,
)

if TYPE_CHECKING:
    from kiln.tasks.evals.evaluate import EvaluateConfig
    from kiln.tasks.scaling.capabilities import CapabilityRow
    from kiln.tasks.settings import KilnConfig
    from kiln.tasks.train.config import OptimConfig, TrainRunConfig

CAPABILITIES_DIR = "capabilities"  # capabilities/<model>/results.json: each scored model's eval results
TRANSFER_DIR = "transfer"  # transfer/<mixture>/: each transfer run


def run(ctx: StageContext) -> dict:

    cfg = ctx.cfg
    if cfg.validate_.capabilities.enabled and cfg.validate_.capabilities.tasks:
        check_capability_tasks(cfg)
    plan = ctx.read_json("fit", PLAN_FILE)
    planned = plan["runs"]["validate"]
    optim = cfg.sweep.optim.model_copy(update={"lr": planned["lr"]})
    result = run_training(ctx, cfg.validate_.model, optim, cfg.validate_.run, plan_mixture(ctx))
    predicted = None
    if planned["predicted_loss"] is not None:
        low, high = planned["interval"]
        predicted = {"loss": planned["predicted_loss"], "low": low, "high": high, "level": planned["level"],
                     "num_params": planned["num_params"], "tokens": planned["tokens"]}
    transfer = (mixture_transfer(ctx, plan, optim, result.val_loss) if cfg.validate_.mixture_transfer.num_mixtures
                else None)
    on_reference = law_run(ctx, plan, transfer)
    capabilities, decisions = None, None
    if cfg.validate_.capabilities.enabled:
        scored: dict[str, ScoredModel] = {}  # by model folder: each model is scored once
        capabilities = score_capabilities(ctx, planned["compute"], on_reference[0] if on_reference else None, scored)
        if transfer and len(transfer["observed"]) >= 2:
            decisions = mixture_decisions(ctx, transfer, planned["compute"], scored)
    report = check_gate(result.val_loss, result.loss_curve, predicted, health_events=result.health_events,
                        grad_norm_curve=result.grad_norm_curve, warmup_steps=optim.warmup_steps, cfg=cfg.validate_,
                        capabilities=capabilities, mixture_transfer=transfer, law_run=on_reference,
                        decision_accuracy=decisions)
    (ctx.out_dir / REPORT_FILE).write_text(json.dumps(report.as_dict(), indent=2))
    law = loss_law_from_dict(plan["loss_law"]) if plan["loss_law"] else None
    plots.plot_law(plan["points"], law, plan["runs"], ctx.out_dir / plots.LAW_PLOT,
                   observed={"validate": on_reference[1] if on_reference else result.val_loss})
    images = [plots.inline_image(ctx.out_dir / plots.LAW_PLOT, "law")]
    if report.capabilities:
        plots.plot_capabilities(report.capabilities, ctx.out_dir / plots.CAPABILITIES_PLOT)
        images.append(plots.inline_image(ctx.out_dir / plots.CAPABILITIES_PLOT, "capabilities"))
    (ctx.out_dir / "gate.md").write_text(f"# Kiln validation gate\n\n```\n{report.describe()}\n```\n\n"
                                         + "\n\n".join(images) + "\n")
    stats = train_stats(result, device=cfg.validate_.run.device, world_size=result.world_size, lr=planned["lr"],
                        gate=report.as_dict(), gate_passed=report.passed)
    if predicted:
        stats |= {"predicted_val_loss": predicted["loss"], "interval_low": predicted["low"],
                  "interval_high": predicted["high"]}
    if on_reference:
        stats["law_run"], stats["law_run_val_loss"] = on_reference
    if transfer and transfer["spearman"] is not None:
        stats["mixture_transfer_spearman"] = transfer["spearman"]
    return stats


def capabilities_eval_config(cfg: KilnConfig) -> EvaluateConfig:
    """The evaluate section the capabilities are scored with: the local suite, `validate.capabilities.limit` items."""
    # The held-out files' tasks only (not the bundled categories): what validate.capabilities was defined on.
    return cfg.evaluate.model_copy(update={"limit": cfg.validate_.capabilities.limit, "standard_suite": False,
                                           "extra_tasks": [], "suite": SuiteConfig()})


def check_capability_tasks(cfg: KilnConfig) -> None:
    """`validate.capabilities.tasks` not in the suite is a ConfigError before the validate run trains,
    not after it, when the capabilities are scored."""

    check_wanted_tasks(cfg.validate_.capabilities.tasks, suite_task_names(capabilities_eval_config(cfg)))


def score_model(ctx: StageContext, name: str, model_dir: Path, compute: float, scored: dict[str, ScoredModel]
                ) -> ScoredModel:
    """The capability suite (`capabilities_eval_config`) on one model, into `capabilities/<name>/`; a model
    already in `scored` (by folder) is not scored again."""
    if str(model_dir) in scored:
        return replace(scored[str(model_dir)], name=name, compute=compute)
    out = ctx.out_dir / CAPABILITIES_DIR / name.replace("/", "-")
    out.mkdir(parents=True, exist_ok=True)  # a resumed attempt scores again into it
    metrics = evaluate_model(capabilities_eval_config(ctx.cfg), model_dir, ctx.inputs["tokenize"] / TOKENIZER_FILE,
                             out, tasks=ctx.cfg.validate_.capabilities.tasks or None)
    scored[str(model_dir)] = ScoredModel(name, compute, metrics,
                                         capability_items(json.loads((out / RESULTS_FILE).read_text(encoding="utf-8"))))
    return scored[str(model_dir)]


def mixture_decisions(ctx: StageContext, transfer: dict[str, Any], midscale_compute: float,
                      scored: dict[str, ScoredModel]) -> dict[str, Any]:
    """Decision accuracy (DataDecide) of each capability task: the mixtures trained at the validate size
    (the transfer runs, the validate run among them) and at the sweep's size (their mixture trials), each
    scored on the capability suite; per task, the share of pairs of mixtures whose order at the sweep's
    size holds at the validate size. A mixture without a sweep trial (the regression's optimum) is left out."""
    sweep_dir = ctx.inputs["sweep"]
    trials = {t.mixture: t for t in load_trials(sweep_dir / TRIALS_FILE) if t.kind == "mixture" and t.ok}
    small, large = {}, {}
    for name in transfer["observed"]:
        if name not in trials:
            continue
        trial = trials[name]
        large_dir = ctx.out_dir / "model" if name == transfer.get("validate_run_is") else \
            ctx.out_dir / TRANSFER_DIR / name / "model"
        large[name] = score_model(ctx, f"{TRANSFER_DIR}/{name}", large_dir, midscale_compute, scored).metrics
        small[name] = score_model(ctx, trial.name, sweep_dir / TRIALS_DIR / trial.name / "model",
                                  6.0 * trial.num_params * trial.tokens, scored).metrics
    by_key = decision_accuracy_by_key(small, large)
    return {"mixtures": sorted(large), "pairs": len(large) * (len(large) - 1) // 2,
            "by_task": {key: value for key, value in by_key.items() if key in primary_metrics(next(iter(large.values())))}
            if large else {}}


def score_capabilities(ctx: StageContext, midscale_compute: float, reference_run: str | None,
                       scored: dict[str, ScoredModel]) -> tuple[list[CapabilityRow], list[str]]:
    """The eval suite (local tasks, `validate.capabilities.limit` items each) on the best proxy of each
    IsoFLOP budget and on the mid-scale model trained on their mixture (`reference_run`, a folder of
    this stage, or the validate run itself when None), and the trend check; the validate run, on
    the plan's other mixture, is scored beside it."""

    caps = ctx.cfg.validate_.capabilities

    def score(name: str, model_dir: Path, compute: float) -> ScoredModel:
        return score_model(ctx, name, model_dir, compute, scored)

    sweep_dir = ctx.inputs["sweep"]
    best = best_isoflop_trials(ctx.cfg.sweep, load_trials(sweep_dir / TRIALS_FILE)).values()
    proxies = [score(t.name, sweep_dir / TRIALS_DIR / t.name / "model", 6.0 * t.num_params * t.tokens) for t in best]
    validate = score("validate", ctx.out_dir / "model", midscale_compute)
    trust = caps.trust  # only trusted tasks decide the gate
    if reference_run is None:
        return capability_trend(proxies, validate, caps, trust=trust)
    return capability_trend(proxies, score(reference_run, ctx.out_dir / reference_run / "model", midscale_compute),
                            caps, plan_model=validate, trust=trust)


def mixture_transfer(ctx: StageContext, plan: dict[str, Any], optim: OptimConfig, validate_loss: float
                     ) -> dict[str, Any]:
    """Train `validate.mixture_transfer.num_mixtures` of the fit's predicted mixtures at the validate
    model's size; their predicted and observed losses and the rank correlation between them. At the
    validate run's length the validate run itself is the plan mixture's run (not trained twice)."""

    cfg = ctx.cfg.validate_
    regression = plan["mixture_regression"]
    predictions = regression.get("predictions") or {}
    if not predictions:
        why = regression.get("refused") or "no mixture regression was fitted"
        return {"predicted": {}, "observed": {}, "spearman": None, "note": f"nothing to rank ({why})"}
    names = choose_transfer_mixtures({n: p["predicted_loss"] for n, p in predictions.items()},
                                     [plan["mixture"]["name"], ctx.cfg.sweep.reference], cfg.mixture_transfer.num_mixtures)
    shards = ctx.read_json("tokenize", SHARDS_FILE)
    steps = cfg.mixture_transfer.steps or cfg.run.steps
    run_cfg = cfg.run.model_copy(update={"steps": steps})
    target = regression["target"]
    observed, diverged, reused = {}, [], None
    subruns = ctx.subruns()
    for name in names:
        if name == plan["mixture"]["name"] and steps == cfg.run.steps and target == "average":
            observed[name], reused = validate_loss, name
            continue
        weights = predictions[name]["weights"]
        sub = SubRun(TRANSFER_DIR, name, {"weights": weights, "steps": steps, "lr": optim.lr},
                     params={"steps": steps, **{f"weight.{d}": w for d, w in weights.items()}})
        stats = subruns.run(sub, lambda folder, recorder: transfer_run(
            replace(ctx, out_dir=folder, recorder=recorder), shards, weights, f"the fit's mixture {name}", optim,
            run_cfg)).stats
        if stats["status"] == "diverged":
            diverged.append(name)
            continue
        observed[name] = stats["val_loss"] if target == "average" else stats["val_loss_by_domain"][target]
    predicted = {n: predictions[n]["predicted_loss"] for n in names}
    rho = transfer_spearman(predicted, observed)
    out: dict[str, Any] = {"predicted": predicted, "observed": observed, "spearman": rho, "target": target,
                           "steps": steps, "diverged": diverged, "validate_run_is": reused}
    if rho is None:
        out["note"] = (f"no rank correlation: {len(observed)} of {len(names)} mixtures finished"
                       + (f" ({', '.join(diverged)} diverged)" if diverged else "") + " or their losses tie")
    return out


def transfer_run(ctx: StageContext, shards: dict, weights: dict[str, float], where: str, optim: OptimConfig,
                 run_cfg: TrainRunConfig) -> dict[str, Any]:
    """One transfer run (into ctx.out_dir, its sub-run folder), where the validate run trains: this process,
    or through cluster.launcher. A divergence is its result, recorded and not run again."""
    from kiln.tasks.train.data_loader import mixture_with_weights  # defers torch

    mixture = mixture_with_weights(shards, ctx.inputs["tokenize"], weights, where)
    try:
        result = run_training(ctx, ctx.cfg.validate_.model, optim, run_cfg, mixture)
    except TrainingDivergedError as error:
        return {"status": "diverged", "reason": str(error)}
    return {"status": "ok", "val_loss": result.val_loss, "val_loss_by_domain": result.val_loss_by_domain,
            "steps": result.steps, "tokens_seen": result.tokens_seen, "final_train_loss": result.final_train_loss}


def law_run(ctx: StageContext, plan: dict[str, Any], transfer: dict[str, Any] | None) -> tuple[str, float] | None:
    """The run held to the law's interval when it is not the validate run: the transfer run on the
    reference mixture (the law's) at the validate run's length, when the plan chose another mixture."""
    reference = ctx.cfg.sweep.reference
    if (transfer is None or plan["mixture"]["name"] == reference or reference not in transfer["observed"]
            or transfer.get("steps") != ctx.cfg.validate_.run.steps or transfer.get("target") != "average"):
        return None
    return f"{TRANSFER_DIR}/{reference}", transfer["observed"][reference]


def headline(stats: dict) -> dict:
    out = {**train_headline(stats), "gate": "passed" if stats["gate_passed"] else "FAILED"}
    if "predicted_val_loss" in stats:
        out["interval"] = f"[{stats['interval_low']:.4f}, {stats['interval_high']:.4f}]"
    if "law_run" in stats:  # the run held to the interval: the one on the law's mixture
        out["reference_val_loss"] = round(stats["law_run_val_loss"], 4)
    if "mixture_transfer_spearman" in stats:
        out["mix_transfer_rho"] = round(stats["mixture_transfer_spearman"], 2)
    return out


# version 2: the gate's interval is the fit's bootstrap prediction interval (no floor); validate.run;
# a failed gate is recorded here and enforced by the train stage. 3: the eval suite against the
# proxies' trend (capabilities), the mixture regression's ranking checked at this size (transfer).
# 4: each transfer run a sub-run (transfer/<mixture>/ with its manifest)
STAGE = Stage(
    name="validate", description="mid-scale run vs the prediction (gate)", body=run,
    inputs=("mix", "fit", "sweep", "tokenize"), config=ValidateConfig,
    reads=("evaluate.eval_files", "evaluate.choice", "evaluate.lines"), external_files=configured_eval_files,
    headline=headline, version=4, reports=("gate.md",), resumable=True,
)
