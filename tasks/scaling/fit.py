"""Fit: turn sweep results into a plan for the bigger runs.

Picks the best learning rate and mixture at the base width, fits a power law
L(N) = A · N^(−α) to each width's best-LR loss (a straight line in log-log space, needs at
least `min_points_for_power_law` widths), and predicts the loss of larger models with an
interval from the fit's residuals. The validate stage holds the plan to that prediction.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from tasks.configbase import Section
from tasks.scaling.sweep import TrialResult

PLAN_FILE = "plan.json"
PLOT_FILE = "scaling.png"


class FitConfig(Section):
    min_points_for_power_law: int = Field(3, ge=2)
    interval_sigmas: float = Field(3.0, gt=0, description="prediction interval half-width in residual std devs")
    min_relative_interval: float = Field(
        0.05, ge=0, description="floor on the interval's relative half-width: tiny fits look exact but are not"
    )


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
             targets: dict[str, int]) -> dict[str, Any]:
    """The plan: best lr and mixture at the base width, the power law, and predictions for `targets`
    (name → non-embedding parameter count)."""
    base = [t for t in trials if t.width == base_width]
    best = min(base, key=lambda t: t.val_loss)
    weights = mixtures[best.mixture]
    total = sum(weights.values())
    reference = next(iter(mixtures))
    points = best_loss_per_width(trials, reference)
    plan: dict[str, Any] = {
        "lr": best.lr,
        "mixture": {"name": best.mixture, "weights": {d: w / total for d, w in sorted(weights.items())}},
        "best_trial": best.name,
        "best_val_loss": best.val_loss,
        "mixture_losses": {m: min(t.val_loss for t in base if t.mixture == m) for m in mixtures},
        "lr_losses": {f"{lr:g}": min(t.val_loss for t in base if t.lr == lr) for lr in sorted({t.lr for t in base})},
        "size_points": [{"width": w, "num_params": n, "val_loss": loss, "best_lr": lr} for w, n, loss, lr in points],
        "power_law": None,
        "predictions": {},
    }
    if len(points) >= cfg.min_points_for_power_law:
        law = fit_power_law([p[1] for p in points], [p[2] for p in points])
        plan["power_law"] = law
        plan["predictions"] = {name: predict(law, n, cfg) for name, n in targets.items()}
    return plan


def plot_plan(plan: dict[str, Any], trials: list[TrialResult], path: Path) -> None:
    """Two panels: loss vs learning rate per mixture, and loss vs parameters with the fitted law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lr, ax_n) = plt.subplots(1, 2, figsize=(10, 4))
    base_width = next(t.width for t in trials if t.name == plan["best_trial"])
    for mixture in sorted({t.mixture for t in trials}):
        rows = sorted((t.lr, t.val_loss) for t in trials if t.width == base_width and t.mixture == mixture)
        ax_lr.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=mixture)
    ax_lr.set(xscale="log", xlabel="learning rate", ylabel="validation loss", title=f"LR sweep (d_model={base_width})")
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
