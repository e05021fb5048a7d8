"""Fit: turn the sweep's trials into laws, and the laws into a plan for the bigger runs.

From the finished trials (diverged and failed ones are listed, never used):

- the loss law L(N, D) = E + A/N^α + B/D^β (`laws.fit_loss_law`) through every (N, D) point
  on the reference mixture, each at its best LR and batch;
- the IsoFLOP parabola minima per budget (`laws.fit_isoflop_minima`), a cross-check of the
  compute-optimal N*(C) the loss law gives in closed form;
- LR*(C) and batch*(C) power laws through each budget's best-width grid
  (`laws.fit_hyperparameter_laws`);
- the mixture regression (ridge and boosted trees, held-out Spearman; `mixture_regression`),
  whose top-k averaged optimum becomes the plan's mixture when it ranks held-out trials well.

A fit that lacks the points it needs is *refused*: the plan says which and why, and what depends
on it falls back to an observed best (never to a silently made-up number). `tasks.scaling.plan`
turns the laws into N, D, shape, steps, LR, batch and a predicted loss with its bootstrap
prediction interval, for the validate run and the production run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from kiln.tasks.configbase import Reference, Section
from kiln.tasks.errors import KilnError
from kiln.tasks.scaling.sweep import (
    SweepConfig,
    TrialResult,
    best_isoflop_trials,
    failure_advice,
    normalised,
    succeeded,
)

if TYPE_CHECKING:  # scipy-backed: loaded where a fit runs, so that the config tree and CLI stay light
    from kiln.tasks.scaling.laws import HyperparameterLaws, LossLawFit

PLAN_FILE = "plan.json"
REPORT_FILE = "report.md"


class FitConfig(Section):
    level: float = Field(0.95, gt=0, lt=1, description="coverage of every interval the fit reports")
    num_bootstrap: int = Field(200, ge=20, description="bootstrap refits of the loss law (its intervals)")
    huber_delta: float = Field(1e-3, gt=0, description="Huber δ on log residuals (Hoffmann et al.'s 1e-3)")
    outlier_mad_k: float | None = Field(
        None, gt=0, description="also drop points whose residual is more than k robust sigmas from the median "
        "(listed in the plan); null: Huber alone limits their pull")
    heldout_fraction: float | None = Field(
        0.2, gt=0, lt=1, description="refit without this fraction of largest-compute points and report its error")
    near_best_rtol: float = Field(0.0025, ge=0, description="runs within this of a budget's best loss count as "
                                  "near-optimal for the LR and batch laws (DeepSeek LLM's 0.25%)")
    mixture_model: Literal["auto", "ridge", "gbm"] = Field(
        "auto", description="the mixture regression (auto: the one with the higher held-out Spearman)")
    mixture_target: str = Field("average", description="'average' of the domains' validation losses, or a domain")
    mixture_folds: int = Field(5, ge=2)
    mixture_candidates: int = Field(20000, ge=100, description="mixtures sampled when searching the optimum")
    mixture_top_k: int = Field(100, ge=1, description="the best candidates averaged into the recommendation")
    min_mixture_spearman: float = Field(
        0.5, ge=-1, le=1, description="below this held-out rank correlation the plan takes the best observed "
        "mixture instead of the regression's")
    budget_flops: float | None = Field(
        None, gt=0, description="the production run's compute (6·N·D) the plan sizes N, D, LR and batch for "
        "(`train.model: plan` trains it); null: no production plan")

    def names_used(self) -> list[Reference]:
        target = [] if self.mixture_target == "average" else [Reference("mixture_target", "domain", (self.mixture_target,))]
        return super().names_used() + target


class NotEnoughTrialsError(KilnError):
    """Too few sweep trials finished for the fit to decide anything; the message says what it needs."""


def law_points(trials: Sequence[TrialResult], reference: str) -> list[dict[str, Any]]:
    """Each (N, D) on the reference mixture once, at its lowest loss over the LRs and batches tried."""
    best: dict[tuple[int, int], TrialResult] = {}
    for t in succeeded(trials):
        if t.mixture != reference:
            continue
        key = (t.num_params, t.tokens or t.tokens_seen)
        if key not in best or t.val_loss < best[key].val_loss:
            best[key] = t
    return [{"n": n, "d": d, "loss": t.val_loss, "budget": t.budget, "width": t.width, "lr": t.lr,
             "batch_size": t.batch_size, "trial": t.name} for (n, d), t in sorted(best.items())]


def fit_laws(cfg: FitConfig, sweep: SweepConfig, trials: Sequence[TrialResult]) -> dict[str, Any]:
    """Every law the trials support; `refused[name]` says why one is missing. Raises
    NotEnoughTrialsError only when no trial on the reference mixture finished."""
    from kiln.tasks.scaling.laws import fit_hyperparameter_laws, fit_isoflop_minima, fit_loss_law  # defers scipy

    reference = sweep.reference
    points = law_points(trials, reference)
    if not points:
        lost = [f"{t.name}: {t.status} ({(t.reason or '')[:80]})" for t in trials if t.mixture == reference][:5]
        raise NotEnoughTrialsError(
            f"no trial on the reference mixture '{reference}' finished, so there is nothing to fit ({'; '.join(lost)}"
            f"). {failure_advice([t for t in trials if t.mixture == reference])}")
    out: dict[str, Any] = {"points": points, "refused": {}, "loss_law": None, "isoflop": None, "hyper": None}
    try:
        out["loss_law"] = fit_loss_law(
            [p["n"] for p in points], [p["d"] for p in points], [p["loss"] for p in points],
            huber_delta=cfg.huber_delta, outlier_mad_k=cfg.outlier_mad_k, num_bootstrap=cfg.num_bootstrap,
            level=cfg.level, heldout_fraction=cfg.heldout_fraction)
    except ValueError as error:
        out["refused"]["loss_law"] = str(error)
    budgeted = [p for p in points if p["budget"] is not None]
    try:
        out["isoflop"] = fit_isoflop_minima([p["n"] for p in budgeted], [p["loss"] for p in budgeted],
                                            [p["budget"] for p in budgeted], level=cfg.level)
    except ValueError as error:
        out["refused"]["isoflop"] = str(error)
    grid = hyper_grid(sweep, trials)
    try:
        out["hyper"] = fit_hyperparameter_laws([t.budget for t in grid], [t.lr for t in grid],
                                               [t.batch_size for t in grid], [t.val_loss for t in grid],
                                               near_best_rtol=cfg.near_best_rtol, level=cfg.level)
    except ValueError as error:
        out["refused"]["hyper"] = str(error)
    return out


def hyper_grid(sweep: SweepConfig, trials: Sequence[TrialResult]) -> list[TrialResult]:
    """The finished trials at each budget's best IsoFLOP width: that budget's LR x batch grid."""
    best = best_isoflop_trials(sweep, trials)
    return [t for t in succeeded(trials) if t.kind in ("isoflop", "hyper") and t.budget in best
            and t.width == best[t.budget].width]


def fit_mixture(cfg: FitConfig, sweep: SweepConfig, trials: Sequence[TrialResult]) -> dict[str, Any]:
    """The mixture regression(s), the chosen model and its recommendation; or the best observed
    mixture with the reason the regression was not used."""
    from kiln.tasks.scaling.mixture_regression import fit_mixture_regression, recommend_mixture  # defers sklearn

    runs = [t for t in succeeded(trials) if t.kind == "mixture"]
    reference = normalised(sweep.mixtures[sweep.reference])
    domains = sorted(d for d, w in reference.items() if w > 0)
    out: dict[str, Any] = {"target": cfg.mixture_target, "domains": domains, "num_trials": len(runs),
                           "models": {}, "chosen": None, "recommendation": None, "refused": None, "predictions": {},
                           "search": {"candidates": cfg.mixture_candidates, "top_k": cfg.mixture_top_k,
                                      "min_spearman": cfg.min_mixture_spearman}}
    observed = [(t, _target(t, cfg.mixture_target)) for t in runs]
    if not observed:
        out["refused"] = "no mixture trial finished"
        out["best_observed"] = None
        return out
    best_trial, best_loss = min(observed, key=lambda pair: pair[1])
    out["best_observed"] = {"name": best_trial.mixture, "weights": best_trial.weights or normalised(
        sweep.mixtures[best_trial.mixture]), "loss": best_loss, "trial": best_trial.name}
    candidates = ("ridge", "gbm") if cfg.mixture_model == "auto" else (cfg.mixture_model,)
    weights = [{d: t.weights.get(d, 0.0) for d in domains} for t in runs]
    fits = {}
    for model in candidates:
        try:
            fits[model] = fit_mixture_regression(weights, [_target(t, cfg.mixture_target) for t in runs],
                                                 domains=domains, model=model, num_folds=cfg.mixture_folds)
        except ValueError as error:
            out["refused"] = str(error)
            return out
        out["models"][model] = {k: v for k, v in fits[model].as_dict().items() if k not in ("targets",)}
    chosen = max(fits, key=lambda m: fits[m].heldout_spearman)
    out["chosen"] = chosen
    fit = fits[chosen]
    search = out["search"]
    rec = recommend_mixture(fit, prior=[reference[d] for d in domains],
                            concentration=sweep.mixture_design.concentration,
                            num_samples=search["candidates"], top_k=min(search["top_k"], search["candidates"]))
    out["recommendation"] = rec.as_dict()
    out["heldout_spearman"] = fit.heldout_spearman
    # What validate's transfer check trains at a larger size: each trial's mixture and the optimum,
    # with the loss the chosen regression (fitted on every trial) predicts for it.
    predicted = fit.predict([[w[d] for d in domains] for w in weights])
    out["predictions"] = {t.mixture: {"weights": w, "predicted_loss": float(p)}
                          for t, w, p in zip(runs, weights, predicted, strict=True)}
    out["predictions"][f"regression-{chosen}"] = {"weights": rec.weights, "predicted_loss": rec.predicted_loss}
    if rec.extrapolates:
        out["refused"] = (f"the regression's optimum lies {rec.nearest_trial_distance:.2f} (L1) from the nearest trial, "
                          "outside the region the trials cover: not a mixture to bet production on; the best "
                          "observed mixture is used (run trials near the optimum, or a wider sweep.mixture_design)")
    if not fit.heldout_spearman >= search["min_spearman"]:
        out["refused"] = (f"the {chosen} regression's held-out Spearman {fit.heldout_spearman:.2f} is below "
                          f"fit.min_mixture_spearman={search['min_spearman']}: it does not rank unseen mixtures "
                          "well enough to choose one; the best observed mixture is used")
    return out


def _target(trial: TrialResult, target: str) -> float:
    if target == "average":
        return float(trial.val_loss)
    if target not in trial.val_loss_by_domain:
        raise KilnError(f"fit.mixture_target={target!r} is not a domain with a validation loss "
                        f"({sorted(trial.val_loss_by_domain)}); use one of them or 'average'")
    return trial.val_loss_by_domain[target]


def chosen_mixture(mixture: dict[str, Any]) -> dict[str, Any]:
    """The plan's mixture: the regression's optimum when trusted, else the best observed trial's."""
    if mixture["recommendation"] is not None and mixture["refused"] is None:
        rec = mixture["recommendation"]
        return {"name": f"regression-{mixture['chosen']}", "weights": rec["weights"], "source": "regression",
                "predicted_loss": rec["predicted_loss"]}
    best = mixture["best_observed"]
    if best is None:
        raise NotEnoughTrialsError("no trial on any mixture finished: nothing to choose a mixture from")
    return {"name": best["name"], "weights": best["weights"], "source": "best observed trial",
            "observed_loss": best["loss"]}


def hyper_at(hyper: HyperparameterLaws | None, trials: Sequence[TrialResult], sweep: SweepConfig,
             compute: float, width: int) -> dict[str, Any]:
    """LR and batch for a run of `compute` FLOPs at `width`: from each law whose exponent the points
    determine, else the best trial of the budget nearest in log compute, its LR moved to `width` by
    the sweep's width rule (`source` says which)."""
    out: dict[str, Any] = {}
    if hyper is not None:
        for name, law, key in (("LR*(C)", hyper.lr_law, "lr"), ("batch*(C)", hyper.batch_law, "batch")):
            low, high = law.exponent_interval
            if low > 0 or high < 0:  # a trend the points show: extrapolate along it
                out[key] = float(law.predict(compute))
                out[f"{key}_interval"] = [float(v) for v in _law_interval(law, compute)]
                out[f"{key}_source"] = f"{name} power law"
    if "lr" not in out or "batch" not in out:
        # No law, or its exponent's interval holds 0 (the grid shows no trend in compute): the best
        # run of the nearest budget, not an extrapolation of noise.
        budgeted = [t for t in succeeded(trials) if t.budget is not None]
        pool = budgeted or succeeded(trials)
        nearest = min(pool, key=lambda t: (abs(math.log((t.budget or compute) / compute)), t.val_loss))
        best = min((t for t in pool if t.budget == nearest.budget), key=lambda t: t.val_loss)
        why = "no LR/batch law (see refused.hyper)" if hyper is None else "its law's exponent interval holds 0"
        lr = best.lr * (best.width / width) ** sweep.lr_width_exponent
        for key, value in (("lr", lr), ("batch", best.batch_size)):
            if key not in out:
                out[key], out[f"{key}_interval"] = value, None
                out[f"{key}_source"] = f"best trial {best.name} ({why})"
    return {"lr": out["lr"], "lr_interval": out["lr_interval"], "batch_size": max(1, round(out["batch"])),
            "batch_interval": out["batch_interval"],
            "source": out["lr_source"] if out["lr_source"] == out["batch_source"]
            else f"lr: {out['lr_source']}; batch: {out['batch_source']}"}


def _law_interval(law: Any, x: float) -> tuple[float, float]:
    """A power law's value at x at its coefficient/exponent interval corners: the range the fit allows."""
    values = [c * x**a for c in law.coefficient_interval for a in law.exponent_interval]
    return min(values), max(values)


def loss_law_from_dict(data: dict[str, Any]) -> LossLawFit:
    """A `LossLawFit` read back from the plan (with its bootstrap), for `kiln plan --budget`."""
    from kiln.tasks.scaling.laws import DroppedPoint, LossLawFit  # defers scipy

    fields = {k: v for k, v in data.items() if k != "bootstrap_params"}
    fields["intervals"] = {k: tuple(v) for k, v in fields["intervals"].items()}
    fields["residuals"] = tuple(fields["residuals"])
    fields["dropped"] = tuple(DroppedPoint(**p) for p in fields["dropped"])
    fields["warnings"] = tuple(fields["warnings"])
    return LossLawFit(**fields, bootstrap_params=np.asarray(data["bootstrap_params"], dtype=float).reshape(-1, 5))


def loss_law_to_dict(law: LossLawFit) -> dict[str, Any]:
    return {**law.as_dict(), "bootstrap_params": law.bootstrap_params.tolist()}


def excluded(trials: Sequence[TrialResult]) -> dict[str, dict[str, Any]]:
    return {t.name: {"status": t.status, "reason": t.reason, "steps": t.steps} for t in trials if not t.ok}


def laws_from_plan(plan: dict[str, Any]) -> tuple[LossLawFit | None, Any, HyperparameterLaws | None]:
    """The loss law, IsoFLOP fit and hyper-parameter laws a plan holds, as objects again."""
    from kiln.tasks.scaling.laws import (  # defers scipy
        BudgetBest,
        HyperparameterLaws,
        IsoFlopFit,
        IsoFlopMinimum,
        PowerLawFit,
        RejectedBudget,
    )

    def power(d: dict[str, Any]) -> PowerLawFit:
        return PowerLawFit(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    law = loss_law_from_dict(plan["loss_law"]) if plan["loss_law"] else None
    iso = plan["isoflop"]
    isoflop = IsoFlopFit(tuple(IsoFlopMinimum(**{**m, "n_range": tuple(m["n_range"])}) for m in iso["minima"]),
                         tuple(RejectedBudget(**r) for r in iso["rejected"]), power(iso["n_law"]),
                         power(iso["d_law"]), tuple(iso["warnings"])) if iso else None
    hp = plan["hyperparameter_laws"]
    hyper = HyperparameterLaws(tuple(BudgetBest(**b) for b in hp["best"]), power(hp["lr_law"]),
                               power(hp["batch_law"]), hp["near_best_rtol"], tuple(hp["warnings"])) if hp else None
    return law, isoflop, hyper
