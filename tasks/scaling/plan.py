"""The plan: what the laws say a run of a given compute (or a given model and token count) should
be, and what loss it should reach, on the data there is.

`plan_for_compute` is the compute-optimal run for a budget C: N*(C) and D*(C) from the loss law
(with bootstrap intervals; the IsoFLOP minima's N*(C) beside it as a cross-check), rounded to a
shape of the sweep's model family (its depth and head size, the width nearest N*), the tokens
C / 6N that shape gets, LR and batch from their laws, and the loss predicted at that shape with a
bootstrap prediction interval. `plan_for_model` predicts a run whose shape and tokens are given
(the validate run; a production run with explicit values). Both are plain dicts: they go into
`plan.json` and `kiln plan --budget` prints them.

**Data.** A run of D tokens on a mixture repeats each domain's unique tokens (tokenize's counts)
w·D / U times. Repeated tokens are worth less than fresh ones: Muennighoff et al. 2023 ("Scaling
Data-Constrained Language Models") fit the effective data D' = U + U·R*·(1 − exp(−R/R*)) for R =
D/U − 1 repetitions, R* ≈ 15.4: four epochs are worth almost four fresh ones, forty far fewer. Every
prediction here uses D' (summed over domains; `data_use`), so a run that repeats its data is not
promised the loss of fresh tokens. `plan_data_feasible` is the run for C that never repeats a domain
more than `mix.max_epochs` times: along C = 6ND, the family width with the lowest predicted
L(N, D'); the compute-optimal run is reported beside it, with its epochs and whether it is allowed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.tasks.errors import KilnError
from kiln.tasks.scaling.fit import PLAN_FILE, hyper_at, laws_from_plan
from kiln.tasks.scaling.sweep import TRIALS_FILE, SweepConfig, TrialResult, load_trials, model_at_width
from kiln.tasks.train.config import ModelConfig

if TYPE_CHECKING:
    from kiln.tasks.scaling.laws import HyperparameterLaws, IsoFlopFit, LossLawFit

MAX_WIDTH_HEADS = 512  # the family's widths considered: 1..512 heads of the proxy head size
R_STAR_D = 15.4  # Muennighoff et al. 2023: repetitions after which repeated data's value has decayed by 1/e


@dataclass(frozen=True)
class DataBudget:
    """The data a run draws from: unique tokens per domain, the mixture's weights, and the most epochs
    of any domain that `mix.max_epochs` allows."""

    unique_tokens: dict[str, int]
    weights: dict[str, float]  # normalised
    max_epochs: float

    def as_dict(self) -> dict[str, Any]:
        return {"unique_tokens": self.unique_tokens, "weights": self.weights, "max_epochs": self.max_epochs,
                "r_star": R_STAR_D}


def unique_tokens(shards: dict) -> dict[str, int]:
    """Each domain's training tokens, from tokenize's `shards.json`: what a run can draw without repeating."""
    return {domain: int(split["train"]["num_tokens"]) for domain, split in sorted(shards["domains"].items())}


def effective_tokens(tokens: float, unique: float) -> float:
    """D' (Muennighoff et al. 2023, eq. 5) of `tokens` drawn from `unique` tokens: all of them while
    nothing repeats, then U + U·R*·(1 − exp(−R/R*)) with R = tokens/U − 1 repetitions."""
    if tokens <= unique:
        return float(tokens)
    repetitions = tokens / unique - 1
    return unique + unique * R_STAR_D * (1 - math.exp(-repetitions / R_STAR_D))


def data_use(tokens: float, data: DataBudget) -> dict[str, Any]:
    """How a run of `tokens` uses the data: each domain's tokens, epochs and effective tokens, the
    effective total D', the most epochs of any domain and whether `max_epochs` allows it."""
    domains = {}
    for domain, weight in data.weights.items():
        drawn, unique = weight * tokens, data.unique_tokens.get(domain, 0)
        if drawn and not unique:
            epochs, effective = math.inf, 0.0
        else:
            epochs = drawn / unique if unique else 0.0
            effective = effective_tokens(drawn, unique)
        domains[domain] = {"tokens": round(drawn), "epochs": epochs, "effective_tokens": effective}
    worst = max(domains, key=lambda d: domains[d]["epochs"])
    return {"domains": domains, "effective_tokens": sum(d["effective_tokens"] for d in domains.values()),
            "max_epochs": domains[worst]["epochs"], "most_repeated": worst,
            "allowed_epochs": data.max_epochs, "within_max_epochs": domains[worst]["epochs"] <= data.max_epochs}


def parameters(model: ModelConfig, vocab_size: int) -> int:
    """The law's N: every parameter, the embedding included (see `sweep.params_at_width`)."""
    from kiln.tasks.train.model import count_parameters  # defers torch

    return count_parameters(model, vocab_size)


def family_width(sweep: SweepConfig, n_target: float, vocab_size: int) -> int:
    """The width of the sweep's family (its depth, head size) whose N is nearest n_target in log."""
    head = sweep.model.head_dim
    widths = [head * k for k in range(1, MAX_WIDTH_HEADS + 1)]
    return min(widths, key=lambda w: abs(math.log(parameters(model_at_width(sweep.model, w), vocab_size) / n_target)))


def budget_from_accelerators(accelerators: int, hours: float, peak_tflops: float, mfu: float) -> float:
    """FLOPs that `accelerators` devices deliver in `hours` at the planner's assumed MFU."""
    if accelerators <= 0 or hours <= 0:
        raise ValueError(f"a budget needs accelerators > 0 and hours > 0 (got {accelerators}, {hours})")
    return accelerators * hours * 3600 * peak_tflops * 1e12 * mfu


def predicted(law: LossLawFit | None, n: float, d: float, data: DataBudget | None = None) -> dict[str, Any]:
    """The law's loss and prediction interval for N = n on d tokens: at their effective count D' when the
    data is known (`data_use` beside it), else as if every token were fresh."""
    if law is None:
        return {"predicted_loss": None, "interval": None}
    use = data_use(d, data) if data is not None else None
    d_eff = use["effective_tokens"] if use is not None else d
    low, high = law.prediction_interval(n, d_eff)
    out = {"predicted_loss": float(law.predict(n, d_eff)), "interval": [low, high], "level": law.level}
    if use is not None:
        out |= {"data": use, "effective_tokens": d_eff,
                "predicted_loss_fresh_data": float(law.predict(n, d))}  # were every token unique
    return out


def plan_for_compute(compute: float, sweep: SweepConfig, vocab_size: int, law: LossLawFit | None,
                     isoflop: IsoFlopFit | None, hyper: HyperparameterLaws | None,
                     trials: Sequence[TrialResult], data: DataBudget | None = None) -> dict[str, Any]:
    """The compute-optimal run for `compute` FLOPs in the sweep's model family (as if data were
    unlimited: its `data` entry says how often it would repeat each domain, and its prediction counts
    the repeats when `data` is given).

    Raises ValueError when there is no loss law: without one there is no N*(C) to plan from.
    """
    if law is None:
        raise ValueError("no loss law was fitted (see the plan's refused.loss_law), so there is no compute-optimal "
                         "N and D to plan: give explicit model and steps, or sweep more (N, D) points")
    optimal = law.compute_optimal([compute])
    out = {"n_opt": optimal.n_opt[0], "n_opt_interval": list(optimal.n_opt_interval[0]),
           "d_opt": optimal.d_opt[0], "d_opt_interval": list(optimal.d_opt_interval[0]),
           "n_exponent": optimal.n_exponent, "n_exponent_interval": list(optimal.n_exponent_interval),
           **_run_at_width(compute, family_width(sweep, optimal.n_opt[0], vocab_size), sweep, vocab_size, law, hyper,
                           trials, data)}
    low, high = isoflop.n_law.exponent_interval if isoflop is not None else (0.0, 0.0)
    if low > 0 or high < 0:  # Chinchilla approach 2 beside approach 3, when its minima show a trend
        out["isoflop_n_opt"] = float(isoflop.n_law.predict(compute))
        out["isoflop_d_opt"] = float(isoflop.d_law.predict(compute))
    return out


def _run_at_width(compute: float, width: int, sweep: SweepConfig, vocab_size: int, law: LossLawFit | None,
                  hyper: HyperparameterLaws | None, trials: Sequence[TrialResult],
                  data: DataBudget | None) -> dict[str, Any]:
    """The run of `compute` FLOPs at a family width: its shape, C / 6N tokens in whole steps at the
    planned batch, LR, and predicted loss."""
    model = model_at_width(sweep.model, width)
    n = parameters(model, vocab_size)
    hp = hyper_at(hyper, trials, sweep, compute, width)
    seq = sweep.run.seq_len
    steps = max(1, round(compute / (6 * n) / (hp["batch_size"] * seq)))
    tokens = steps * hp["batch_size"] * seq
    return {"compute": compute, "width": width, "model": model.model_dump(mode="json"), "num_params": n,
            "tokens": tokens, "seq_len": seq, "batch_size": hp["batch_size"], "steps": steps,
            "lr": hp["lr"], "lr_interval": hp["lr_interval"], "batch_interval": hp["batch_interval"],
            "hyperparameters_from": hp["source"], **predicted(law, n, tokens, data)}


def plan_data_feasible(compute: float, sweep: SweepConfig, vocab_size: int, law: LossLawFit,
                       hyper: HyperparameterLaws | None, trials: Sequence[TrialResult],
                       data: DataBudget, compute_optimal: dict[str, Any]) -> dict[str, Any]:
    """The run of `compute` FLOPs that repeats no domain more than `data.max_epochs` times: the family
    width whose run (C / 6N tokens) is within the limit and has the lowest predicted L(N, D'). The
    compute-optimal run itself when it is within the limit and nothing beats it. Raises ValueError
    (saying why) when no width of the family keeps the data within the limit."""
    head = sweep.model.head_dim
    best: tuple[float, int] | None = None  # (predicted loss, width) of the best width within the limit
    if compute_optimal["data"]["within_max_epochs"]:
        best = (compute_optimal["predicted_loss"], compute_optimal["width"])
    for width in range(head, head * MAX_WIDTH_HEADS + 1, head):  # point predictions; the interval for the winner
        n = parameters(model_at_width(sweep.model, width), vocab_size)
        batch = hyper_at(hyper, trials, sweep, compute, width)["batch_size"]
        tokens = max(1, round(compute / (6 * n) / (batch * sweep.run.seq_len))) * batch * sweep.run.seq_len
        use = data_use(tokens, data)
        loss = float(law.predict(n, use["effective_tokens"]))
        if use["within_max_epochs"] and (best is None or loss < best[0]):
            best = (loss, width)
    if best is None:
        widest = _run_at_width(compute, head * MAX_WIDTH_HEADS, sweep, vocab_size, law, hyper, trials, data)["data"]
        raise ValueError(
            f"no model of the family trains {compute:.3g} FLOPs within mix.max_epochs={data.max_epochs:g}: even the "
            f"widest ({head * MAX_WIDTH_HEADS}) repeats {widest['most_repeated']} {widest['max_epochs']:.1f} times. "
            "Add data, lower the budget (fit.budget_flops), or raise mix.max_epochs")
    if best[1] == compute_optimal["width"]:
        return {**compute_optimal, "chosen_because": "the compute-optimal run repeats no domain more than "
                f"mix.max_epochs={data.max_epochs:g} times"}
    chosen = _run_at_width(compute, best[1], sweep, vocab_size, law, hyper, trials, data)
    co = compute_optimal
    why = (f"the compute-optimal run ({co['num_params']:,} parameters on {co['tokens']:,} tokens) "
           + (f"repeats {co['data']['most_repeated']} {co['data']['max_epochs']:.1f} times, over mix.max_epochs="
              f"{data.max_epochs:g}" if not co["data"]["within_max_epochs"]
              else f"is predicted {co['predicted_loss']:.4f} with repeated data")
           + f"; this width is the family's best within the limit, predicted {chosen['predicted_loss']:.4f} on "
             f"D' = {chosen['effective_tokens']:,.0f} effective tokens")
    return {**chosen, "chosen_because": why}


def plan_for_model(model: ModelConfig, tokens: int, batch_size: int, seq_len: int, sweep: SweepConfig,
                   vocab_size: int, law: LossLawFit | None, hyper: HyperparameterLaws | None,
                   trials: Sequence[TrialResult], data: DataBudget | None = None) -> dict[str, Any]:
    """The prediction and hyper-parameters for a run of a given shape and token count."""
    n = parameters(model, vocab_size)
    compute = 6.0 * n * tokens
    hp = hyper_at(hyper, trials, sweep, compute, model.d_model)
    out = {"compute": compute, "model": model.model_dump(mode="json"), "num_params": n, "tokens": tokens,
           "seq_len": seq_len, "batch_size": batch_size, "steps": max(1, round(tokens / (batch_size * seq_len))),
           "lr": hp["lr"], "lr_interval": hp["lr_interval"], "planned_batch_size": hp["batch_size"],
           "hyperparameters_from": hp["source"], **predicted(law, n, tokens, data)}
    if law is not None:
        optimal = law.compute_optimal([compute])
        out["n_opt"], out["d_opt"] = optimal.n_opt[0], optimal.d_opt[0]
    return out


def describe(run: dict[str, Any], name: str) -> str:
    """A few lines a person reads: the run's size, tokens, LR, batch and predicted loss."""
    lines = [f"{name}: C = {run['compute']:.3g} FLOPs (6·N·D)"]
    if "n_opt" in run:
        iv = run.get("n_opt_interval")
        lines.append(f"  compute-optimal N* = {run['n_opt']:.3g}" + (f" [{iv[0]:.3g}, {iv[1]:.3g}]" if iv else "")
                     + f", D* = {run['d_opt']:.3g} tokens")
    if "isoflop_n_opt" in run:
        lines.append(f"  IsoFLOP minima (approach 2) N* = {run['isoflop_n_opt']:.3g}, D* = {run['isoflop_d_opt']:.3g}")
    model = run["model"]
    lines.append(f"  model: d_model={model['d_model']} n_layers={model['n_layers']} n_heads={model['n_heads']} "
                 f"({run['num_params']:,} parameters)")
    lines.append(f"  tokens {run['tokens']:,} = {run['steps']:,} steps x batch {run['batch_size']} x seq {run['seq_len']}")
    lr_iv = run.get("lr_interval")
    lines.append(f"  lr {run['lr']:.3g}" + (f" [{lr_iv[0]:.3g}, {lr_iv[1]:.3g}]" if lr_iv else "")
                 + f" ({run['hyperparameters_from']})")
    if "data" in run:
        use = run["data"]
        allowed = "within" if use["within_max_epochs"] else "OVER"
        lines.append(f"  data: {use['most_repeated']} repeated {use['max_epochs']:.2f} times ({allowed} "
                     f"mix.max_epochs={use['allowed_epochs']:g}); effective tokens D' = {use['effective_tokens']:,.0f}")
    if run.get("predicted_loss") is not None:
        lo, hi = run["interval"]
        lines.append(f"  predicted loss {run['predicted_loss']:.4f}, {run['level']:.0%} prediction interval "
                     f"[{lo:.4f}, {hi:.4f}]" + (" (on D')" if "data" in run else ""))
    if "chosen_because" in run:
        lines.append(f"  chosen: {run['chosen_because']}")
    return "\n".join(lines)


def budget_report(sweep: SweepConfig, compute: float, fit_dir: Path, sweep_dir: Path) -> tuple[str, dict[str, Any]]:
    """`kiln plan CONFIG --budget`: the compute-optimal and the data-feasible run for `compute` FLOPs
    from a completed fit (and its sweep); the report and the runs as a dict."""

    plan = json.loads((fit_dir / PLAN_FILE).read_text())
    trials = load_trials(sweep_dir / TRIALS_FILE)
    law, isoflop, hyper = laws_from_plan(plan)
    data = DataBudget(**{k: v for k, v in plan["data"].items() if k != "r_star"}) if plan.get("data") else None
    vocab_size = plan["family"]["vocab_size"]
    try:
        optimal = plan_for_compute(compute, sweep, vocab_size, law, isoflop, hyper, trials, data)
    except ValueError as error:
        raise KilnError(str(error)) from None
    runs, lines = {"compute_optimal": optimal}, [describe(optimal, "compute-optimal run")]
    if data is not None:
        try:
            runs["production"] = plan_data_feasible(compute, sweep, vocab_size, law, hyper, trials, data, optimal)
            lines.append(describe(runs["production"], "data-feasible run"))
        except ValueError as error:
            lines.append(f"data-feasible run: refused: {error}")
    lines.append(f"  mixture {plan['mixture']['name']} ({plan['mixture']['source']}): "
                 + ", ".join(f"{d} {w:.3f}" for d, w in plan["mixture"]["weights"].items()))
    warnings = [w for w in plan["warnings"] if "interval" in w or "extrapolat" in w]
    lines += [f"  warning: {w}" for w in warnings]
    lines.append(f"  (fit {fit_dir})")
    return "\n".join(lines) + "\n", runs
