"""The fit's plots, each answering one question at a glance; PNGs for MLflow, inlined in the Prefect report.

- `isoflop.png`: loss against model size per compute budget, with each budget's parabola and its
  minimum, and N*(C) from the minima beside N*(C) from the loss law (with its interval).
- `law.png`: loss against compute: the trials, the loss law's compute-optimal frontier with its
  bootstrap band, and the planned runs' predictions (and, after validate, the observed loss).
- `hyperparameters.png`: loss against LR and against batch per budget at its best width, and the
  LR*(C) and batch*(C) laws.
- `mixture.png`: predicted loss along each domain's weight (the others in their reference
  proportions) with the trials, and held-out predicted against observed loss.
- `capabilities.png` (validate): each eval metric against compute, the best proxy per budget with
  their trend line, and the mid-scale model.
- `loss_vs_compute.png` and `gap_vs_compute.png` (research): each variant's final loss against its own
  compute (mean and spread over seeds), and its gap to the baseline against the baseline's compute
  with the intervals per scale and the trend extrapolated to production size.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.scaling.laws import HyperparameterLaws, IsoFlopFit, LossLawFit, compute_optimal_allocation
from kiln.tasks.scaling.sweep import TrialResult

ISOFLOP_PLOT, LAW_PLOT, HYPER_PLOT, MIXTURE_PLOT = "isoflop.png", "law.png", "hyperparameters.png", "mixture.png"
CAPABILITIES_PLOT = "capabilities.png"
DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(count: int) -> list[Any]:
    plt = _pyplot()
    return [plt.cm.viridis(x) for x in np.linspace(0.1, 0.85, max(count, 1))]


def plot_isoflop(points: Sequence[dict[str, Any]], isoflop: IsoFlopFit | None, law: LossLawFit | None,
                 path: Path) -> None:
    plt = _pyplot()
    fig, (ax, ax_n) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    budgets = sorted({p["budget"] for p in points if p["budget"] is not None})
    minima = {round(m.compute, -5): m for m in (isoflop.minima if isoflop else ())}
    for colour, budget in zip(_colours(len(budgets)), budgets, strict=True):
        rows = sorted((p["n"], p["loss"]) for p in points if p["budget"] == budget)
        n, loss = np.array(rows).T
        ax.scatter(n, loss, color=colour, label=f"C = {budget:.2g}", zorder=3)
        if len(rows) >= 3:
            coef = np.polyfit(np.log(n), loss, 2)
            grid = np.geomspace(n.min() / 1.2, n.max() * 1.2, 60)
            ax.plot(grid, np.polyval(coef, np.log(grid)), color=colour, lw=1)
        m = next((m for c, m in minima.items() if abs(np.log(c / budget)) < 0.05), None)
        if m is not None:
            ax.scatter([m.n_opt], [m.loss_at_opt], marker="*", s=160, color=colour, edgecolor="black", zorder=4)
    ax.set(xscale="log", xlabel="parameters N (embedding included)", ylabel="validation loss",
           title="IsoFLOP profiles (★ parabola minimum)")
    ax.legend(fontsize=8)
    if not budgets or (isoflop is None and law is None):
        ax_n.set_axis_off()
        ax_n.text(0.5, 0.5, "no IsoFLOP fit and no loss law\n(see refused in plan.json)", ha="center", va="center")
    else:
        cs = np.geomspace(min(budgets) / 2, max(budgets) * 4, 50)
        if isoflop is not None:
            ax_n.scatter([m.compute for m in isoflop.minima], [m.n_opt for m in isoflop.minima], color="black",
                         label="parabola minima", zorder=3)
            ax_n.plot(cs, isoflop.n_law.predict(cs), color="black", lw=1,
                      label=f"approach 2: N* ∝ C^{isoflop.n_law.exponent:.2f}")
        if law is not None:
            opt = law.compute_optimal(cs)
            ax_n.plot(cs, opt.n_opt, color="tab:red", label=f"loss law: N* ∝ C^{opt.n_exponent:.2f}")
            band = np.array(opt.n_opt_interval)
            if np.all(np.isfinite(band)):
                ax_n.fill_between(cs, band[:, 0], band[:, 1], color="tab:red", alpha=0.15,
                                  label=f"{law.level:.0%} interval")
        ax_n.set(xscale="log", yscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="compute-optimal N*",
                 title="Compute-optimal model size")
        ax_n.legend(fontsize=8)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_law(points: Sequence[dict[str, Any]], law: LossLawFit | None, runs: dict[str, dict[str, Any]],
             path: Path, observed: dict[str, float] | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    compute = np.array([6.0 * p["n"] * p["d"] for p in points])
    scatter = ax.scatter(compute, [p["loss"] for p in points], c=np.log10([p["n"] for p in points]),
                         cmap="viridis", zorder=3, label="proxy runs (best LR, batch)")
    fig.colorbar(scatter, ax=ax, label="log10 N")
    targets = [r["compute"] for r in runs.values()]
    if law is not None:
        cs = np.geomspace(compute.min() / 2, max([compute.max(), *targets]) * 2, 80)
        opt = law.compute_optimal(cs)
        frontier = law.predict(np.array(opt.n_opt), np.array(opt.d_opt))
        boot = law.bootstrap_params
        band = None
        if len(boot):

            bn, bd = compute_optimal_allocation(cs[None, :], boot[:, 1:2], boot[:, 2:3], boot[:, 3:4], boot[:, 4:5])
            curves = boot[:, 0:1] + boot[:, 1:2] / bn ** boot[:, 3:4] + boot[:, 2:3] / bd ** boot[:, 4:5]
            band = np.quantile(curves, [(1 - law.level) / 2, (1 + law.level) / 2], axis=0)
        label = (f"L = {law.E:.2f} + {law.A:.3g}/N^{law.alpha:.2f} + {law.B:.3g}/D^{law.beta:.2f}, "
                 "at compute-optimal N, D")
        ax.plot(cs, frontier, color="tab:red", label=label)
        if band is not None:
            ax.fill_between(cs, band[0], band[1], color="tab:red", alpha=0.15, label=f"{law.level:.0%} band (bootstrap)")
    markers = {"validate": "s", "production": "D", "compute_optimal": "o"}
    colours = {"validate": "tab:orange", "production": "tab:purple"}
    for name, run in runs.items():
        if run.get("predicted_loss") is None:
            continue
        lo, hi = run["interval"]
        loss = run["predicted_loss"]
        ax.errorbar([run["compute"]], [loss], yerr=[[loss - lo], [hi - loss]], fmt=markers.get(name, "o"),
                    color=colours.get(name, "tab:gray"), capsize=5,
                    label=f"{name}: predicted {loss:.3f} [{lo:.3f}, {hi:.3f}]")
        if observed and name in observed:
            ax.scatter([run["compute"]], [observed[name]], marker="x", s=120, color="black", zorder=5,
                       label=f"{name}: observed {observed[name]:.3f}")
    ax.set(xscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="validation loss",
           title="Loss against compute: the fitted law and its predictions")
    ax.legend(fontsize=7, loc="lower left")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_hyperparameters(grid: Sequence[TrialResult], hyper: HyperparameterLaws | None, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), layout="constrained")
    ax_lr, ax_bs, ax_law = axes
    budgets = sorted({t.budget for t in grid})
    for colour, budget in zip(_colours(len(budgets)), budgets, strict=True):
        at = [t for t in grid if t.budget == budget]
        best = min(t.val_loss for t in at)
        for batch in sorted({t.batch_size for t in at}):
            rows = sorted((t.lr, t.val_loss - best) for t in at if t.batch_size == batch)
            ax_lr.plot(*zip(*rows, strict=True), marker="o", color=colour,
                       ls="-" if batch == min(t.batch_size for t in at) else "--",
                       label=f"C={budget:.2g}, batch {batch}")
        for lr in sorted({t.lr for t in at}):
            rows = sorted((t.batch_size, t.val_loss - best) for t in at if t.lr == lr)
            if len(rows) > 1:
                ax_bs.plot(*zip(*rows, strict=True), marker="o", color=colour, label=f"C={budget:.2g}, lr {lr:.2g}")
    ax_lr.set(xscale="log", xlabel="learning rate", ylabel="loss − budget's best", title="LR sensitivity")
    ax_lr.legend(fontsize=7)
    if ax_bs.lines:
        ax_bs.set(xscale="log", xlabel="batch size (sequences)", ylabel="loss − budget's best",
                  title="Batch sensitivity")
        ax_bs.legend(fontsize=7)
    else:
        ax_bs.set_axis_off()
        ax_bs.text(0.5, 0.5, "one batch size swept\n(add sizes in sweep.batch_sizes)", ha="center", va="center")
    if hyper is not None:
        cs = np.array([b.compute for b in hyper.best])
        grid_c = np.geomspace(cs.min() / 2, cs.max() * 8, 50)
        ax_law.scatter(cs, [b.lr for b in hyper.best], color="tab:blue")
        ax_law.plot(grid_c, hyper.lr_law.predict(grid_c), color="tab:blue",
                    label=f"LR* = {hyper.lr_law.coefficient:.3g}·C^{hyper.lr_law.exponent:.3f}")
        twin = ax_law.twinx()
        twin.scatter(cs, [b.batch for b in hyper.best], color="tab:green", marker="s")
        twin.plot(grid_c, hyper.batch_law.predict(grid_c), color="tab:green", ls="--",
                  label=f"batch* = {hyper.batch_law.coefficient:.3g}·C^{hyper.batch_law.exponent:.3f}")
        twin.set(yscale="log", ylabel="best batch (sequences)")
        ax_law.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="best LR",
                   title="LR*(C) and batch*(C)")
        handles = ax_law.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax_law.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    else:
        ax_law.set_axis_off()
        ax_law.text(0.5, 0.5, "no LR/batch law\n(see refused.hyper in plan.json)", ha="center", va="center")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_mixture(mixture: dict[str, Any], fit: Any, reference: dict[str, float], trial_weights: np.ndarray,
                 targets: Sequence[float], path: Path) -> None:
    """`fit`: the chosen `MixtureRegressionFit` (None when refused before fitting)."""
    plt = _pyplot()
    domains = mixture["domains"]
    fig, axes = plt.subplots(1, len(domains) + 1, figsize=(3.3 * (len(domains) + 1), 3.6), layout="constrained",
                             squeeze=False)
    axes = axes[0]
    ref = np.array([reference[d] for d in domains])
    rec = mixture["recommendation"]
    for i, (ax, domain) in enumerate(zip(axes, domains, strict=False)):
        ax.scatter(trial_weights[:, i], targets, s=14, color="grey", label="trials")
        if fit is not None:
            share = np.linspace(0.01, 0.95, 60)
            rest = np.delete(ref, i)
            rows = np.empty((len(share), len(domains)))
            rows[:, i] = share
            rows[:, np.arange(len(domains)) != i] = (1 - share)[:, None] * rest / rest.sum()
            ax.plot(share, fit.predict(rows), color="tab:red", label="predicted")
        if rec is not None:
            ax.axvline(rec["weights"][domain], color="tab:purple", ls="--", lw=1, label="recommended")
        ax.set(xlabel=f"weight of {domain}", title=domain)
        if i == 0:
            ax.set_ylabel(f"{mixture['target']} val loss")
            ax.legend(fontsize=7)
    ax = axes[-1]
    if fit is not None:
        ax.scatter(fit.targets, fit.heldout_predictions, s=14)
        lims = [min(fit.targets), max(fit.targets)]
        ax.plot(lims, lims, color="black", lw=1)
        ax.set(xlabel="observed", ylabel="held-out prediction",
               title=f"{fit.model}: held-out Spearman {fit.heldout_spearman:.2f}")
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no regression\n(see the plan's mixture.refused)", ha="center", va="center")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_capabilities(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """`rows`: the gate report's `capabilities` (`CapabilityRow.as_dict()`), one panel each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.6), layout="constrained", squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        compute = [c for _, c, _ in row["proxies"]]
        ax.plot(compute, [v for _, _, v in row["proxies"]], marker="o", color="tab:blue", label="best proxy per budget")
        if row["slope_per_decade"] is not None:
            xs = np.geomspace(min(compute), row["midscale_compute"], 20)
            intercept = row["trend_at_midscale"] - row["slope_per_decade"] * np.log10(row["midscale_compute"])
            ax.plot(xs, intercept + row["slope_per_decade"] * np.log10(xs), ls=":", color="tab:blue",
                    label="proxies' trend")
        ax.scatter([row["midscale_compute"]], [row["midscale"]], marker="*", s=160, zorder=4,
                   color="tab:green" if row["continues"] else "tab:red",
                   label="mid-scale (" + ("continues" if row["continues"] else "breaks") + " the trend)")
        if row["plan_mixture"] is not None:
            ax.scatter([row["midscale_compute"]], [row["plan_mixture"]], marker="*", s=160, zorder=4,
                       facecolor="none", edgecolor="grey", label="mid-scale, plan's mixture")
        direction = "higher" if row["higher_is_better"] else "lower"
        ax.set(xscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel=f"{row['metric'].split('/')[1]} ({direction} "
               "is better)", title=row["metric"].split("/")[0] + ("" if row["gated"] else " (not gated)"))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # 2x10^9, 3x10^9, ... labels overlap
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_research_loss(points: dict[str, list[tuple[float, float, float]]], path: Path) -> None:
    """`points`: variant -> (its compute, mean final loss, seed standard deviation) per scale."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4), layout="constrained")
    for colour, (name, rows) in zip(_colours(len(points)), points.items(), strict=True):
        rows = sorted(rows)
        ax.errorbar([r[0] for r in rows], [r[1] for r in rows], yerr=[r[2] for r in rows], marker="o", capsize=3,
                    color="black" if name == "baseline" else colour, label=name)
    ax.set(xscale="log", xlabel="training compute C = 6ND of the variant (FLOPs)", ylabel="final validation loss",
           title="loss vs compute (mean ± seed sd)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_research_gap(decision: dict[str, Any], path: Path) -> None:
    """`decision`: decision.json's content: per variant the effect per scale with its interval, and the
    trend (slope per decade through the extrapolated effect) out to the production compute."""
    plt = _pyplot()
    variants = decision["variants"]
    computes = {s: v["flops"] for s, v in decision["scales"].items()}
    production = decision["production_flops"]
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    ax.axhline(0, color="grey", lw=0.8)
    for colour, (name, v) in zip(_colours(len(variants)), variants.items(), strict=True):
        scales = [s for s in computes if s in v["effect_by_scale"]]
        xs = [computes[s] for s in scales]
        e = [v["effect_by_scale"][s] for s in scales]
        ax.errorbar(xs, [r["mean"] for r in e], yerr=[[r["mean"] - r["ci_low"] for r in e],
                                                      [r["ci_high"] - r["mean"] for r in e]],
                    marker="o", capsize=3, ls="none", color=colour, label=f"{name}: {v['decision']}")
        x = v["extrapolated"]
        line = np.geomspace(min(computes.values()), production, 20)
        ax.plot(line, x["mean"] + x["slope_per_decade"] * (np.log10(line) - np.log10(production)), ls=":",
                color=colour)
        ax.errorbar([production], [x["mean"]], yerr=[[x["mean"] - x["ci_low"]], [x["ci_high"] - x["mean"]]],
                    marker="*", ms=10, capsize=4, color=colour)
    ax.set(xscale="log", xlabel="baseline training compute (FLOPs); * = production", ylabel="Δ loss (variant − baseline)",
           title="gap vs compute (intervals; trend to production)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def inline_image(path: Path, alt: str) -> str:
    """Markdown for a PNG embedded as data, so the Prefect artifact shows it without a file server."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"
