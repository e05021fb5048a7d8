"""Fit: turn sweep results into a plan for the bigger runs.

Picks the best learning rate and mixture at the base width, fits a power law
L(N) = A · N^(−α) to each width's best-LR loss (a straight line in log-log space, needs at
least `min_points_for_power_law` widths), and predicts the loss of larger models with an
interval from the fit's residuals. The validate stage holds the plan to that prediction.

Only trials that finished (status "ok") count; diverged and failed ones are listed in the plan
with their reasons. A fit refuses (`NotEnoughTrialsError`) rather than quietly deciding on less:
when a mixture has no finished trial at the base width, or failures leave fewer widths than the
power law needs although the design had enough. The mixture, LR and size axes use the trials at
the run's batch size; the others give the plan's per-batch-size best losses.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from tasks.configbase import Section
from tasks.errors import KilnError
from tasks.scaling.sweep import TrialResult, succeeded

PLAN_FILE = "plan.json"
PLOT_FILE = "scaling.png"


class FitConfig(Section):
    min_points_for_power_law: int = Field(3, ge=2)
    interval_sigmas: float = Field(3.0, gt=0, description="prediction interval half-width in residual std devs")
    min_relative_interval: float = Field(
        0.05, ge=0, description="floor on the interval's relative half-width: tiny fits look exact but are not"
    )


class NotEnoughTrialsError(KilnError):
    """Too few sweep trials finished for the fit to decide; the message says what it needs."""


def best_loss_per_width(trials: list[TrialResult], mixture: str) -> list[tuple[int, int, float, float]]:
    """(width, non-embedding params, best val loss, its lr) for every width swept on `mixture`."""
    rows = []
    for width in sorted({t.width for t in trials if t.mixture == mixture}):
        best = min((t for t in trials if t.width == width and t.mixture == mixture), key=lambda t: t.val_loss)
        rows.append((width, best.non_embedding_params, best.val_loss, best.lr))
    return rows


def fit_power_law(num_params: list[int], losses: list[float]) -> dict[str, float]:
    """Least squares on log L = log A − α log N; returns A, alpha and the residual std (log space)."""
    x = np.log(np.asarray(num_params, dtype=float))
    y = np.log(np.asarray(losses, dtype=float))
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (slope * x + intercept)
    dof = max(len(x) - 2, 1)
    return {"A": float(math.exp(intercept)), "alpha": float(-slope),
            "residual_sigma": float(math.sqrt(float(residuals @ residuals) / dof))}


def predict(law: dict[str, float], num_params: int, cfg: FitConfig) -> dict[str, float]:
    loss = law["A"] * num_params ** (-law["alpha"])
    half_width = max(cfg.interval_sigmas * law["residual_sigma"], math.log1p(cfg.min_relative_interval))
    return {"num_params": num_params, "loss": loss, "low": loss * math.exp(-half_width),
            "high": loss * math.exp(half_width)}


def fit_plan(cfg: FitConfig, trials: list[TrialResult], base_width: int, mixtures: dict[str, dict[str, float]],
             targets: dict[str, int], batch_size: int) -> dict[str, Any]:
    """The plan: best lr and mixture at the base width, the power law, and predictions for `targets`
    (name → non-embedding parameter count). `batch_size` is the run's: the mixture, LR and size axes
    use the trials at it. Trials that did not finish are left out (and listed)."""
    ok = succeeded(trials)
    at_batch = [t for t in ok if t.batch_size == batch_size]
    base = [t for t in at_batch if t.width == base_width]
    reference = next(iter(mixtures))
    _check_enough(cfg, trials, at_batch, base, base_width, batch_size, mixtures, reference)
    best = min(base, key=lambda t: t.val_loss)
    weights = mixtures[best.mixture]
    total = sum(weights.values())
    points = best_loss_per_width(at_batch, reference)
    by_batch = {}
    for b in sorted({t.batch_size for t in ok if t.width == base_width and t.mixture == reference}):
        top = min((t for t in ok if t.width == base_width and t.mixture == reference and t.batch_size == b),
                  key=lambda t: t.val_loss)
        by_batch[str(b)] = {"val_loss": top.val_loss, "best_lr": top.lr}
    plan: dict[str, Any] = {
        "lr": best.lr,
        "mixture": {"name": best.mixture, "weights": {d: w / total for d, w in sorted(weights.items())}},
        "best_trial": best.name,
        "best_val_loss": best.val_loss,
        "mixture_losses": {m: min(t.val_loss for t in base if t.mixture == m) for m in mixtures},
        "lr_losses": {f"{lr:g}": min(t.val_loss for t in base if t.lr == lr) for lr in sorted({t.lr for t in base})},
        "batch_size_losses": by_batch,
        "size_points": [{"width": w, "num_params": n, "val_loss": loss, "best_lr": lr} for w, n, loss, lr in points],
        "excluded_trials": {t.name: {"status": t.status, "reason": t.reason, "steps": t.steps}
                            for t in trials if not t.ok},
        "power_law": None,
        "predictions": {},
    }
    if len(points) >= cfg.min_points_for_power_law:
        law = fit_power_law([p[1] for p in points], [p[2] for p in points])
        plan["power_law"] = law
        plan["predictions"] = {name: predict(law, n, cfg) for name, n in targets.items()}
    return plan


def _check_enough(cfg: FitConfig, trials: list[TrialResult], at_batch: list[TrialResult], base: list[TrialResult],
                  base_width: int, batch_size: int, mixtures: dict[str, dict[str, float]], reference: str) -> None:
    """Raise NotEnoughTrialsError when failures leave the fit without what it needs."""
    def lost(where: list[TrialResult]) -> str:
        failed = [f"{t.name} {t.status} at step {t.steps}" for t in where if not t.ok]
        return ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "") or "none designed"

    at_base = [t for t in trials if t.width == base_width and t.batch_size == batch_size]
    missing = [m for m in mixtures if not any(t.mixture == m for t in base)]
    if missing:
        raise NotEnoughTrialsError(
            f"the fit needs at least one finished trial per mixture at the base width d_model={base_width} "
            f"(batch size {batch_size}) to choose among them; mixtures {missing} have none "
            f"({lost([t for t in at_base if t.mixture in missing])}). Lower sweep.lrs or add a smaller one "
            "so every mixture has a stable learning rate.")
    designed = sorted({t.width for t in trials if t.mixture == reference and t.batch_size == batch_size})
    usable = sorted({t.width for t in at_batch if t.mixture == reference})
    if len(designed) >= cfg.min_points_for_power_law > len(usable):
        raise NotEnoughTrialsError(
            f"the power law needs finished trials at {cfg.min_points_for_power_law} widths "
            f"(fit.min_points_for_power_law) on the reference mixture '{reference}'; the sweep designed "
            f"{designed} but only {usable} have one. Widths without: "
            + "; ".join(f"d_model={w}: " + lost([t for t in trials if t.width == w and t.mixture == reference
                                                  and t.batch_size == batch_size])
                        for w in designed if w not in usable)
            + ". Lower sweep.lrs so each width has a stable learning rate.")


def plot_plan(plan: dict[str, Any], trials: list[TrialResult], path: Path) -> None:
    """Two panels: loss vs learning rate per mixture, and loss vs parameters with the fitted law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lr, ax_n) = plt.subplots(1, 2, figsize=(10, 4))
    best = next(t for t in trials if t.name == plan["best_trial"])
    shown = [t for t in succeeded(trials) if t.width == best.width and t.batch_size == best.batch_size]
    for mixture in sorted({t.mixture for t in shown}):
        rows = sorted((t.lr, t.val_loss) for t in shown if t.mixture == mixture)
        ax_lr.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=mixture)
    not_finished = sum(not t.ok for t in trials if t.width == best.width and t.batch_size == best.batch_size)
    ax_lr.set(xscale="log", xlabel="learning rate", ylabel="validation loss",
              title=f"LR sweep (d_model={best.width})" + (f", {not_finished} diverged/failed" if not_finished else ""))
    ax_lr.legend()
    points = plan["size_points"]
    ax_n.scatter([p["num_params"] for p in points], [p["val_loss"] for p in points], label="best-LR loss")
    law = plan["power_law"]
    if law:
        grid = np.geomspace(min(p["num_params"] for p in points),
                            max([p["num_params"] for p in points] + [p["num_params"] for p in plan["predictions"].values()]), 50)
        ax_n.plot(grid, law["A"] * grid ** (-law["alpha"]), label=f"L = {law['A']:.2f}·N^-{law['alpha']:.3f}")
        for name, pred in plan["predictions"].items():
            ax_n.errorbar([pred["num_params"]], [pred["loss"]],
                          yerr=[[pred["loss"] - pred["low"]], [pred["high"] - pred["loss"]]], fmt="s", capsize=4,
                          label=f"{name} prediction")
            if "observed" in pred:
                ax_n.scatter([pred["num_params"]], [pred["observed"]], marker="x", s=80, label=f"{name} observed")
    ax_n.set(xscale="log", yscale="log", xlabel="non-embedding parameters", ylabel="validation loss", title="Scaling fit")
    ax_n.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
