"""The plan: what the laws say a run of a given compute (or a given model and token count) should
be, and what loss it should reach.

`plan_for_compute` is the compute-optimal run for a budget C: N*(C) and D*(C) from the loss law
(with bootstrap intervals; the IsoFLOP minima's N*(C) beside it as a cross-check), rounded to a
shape of the sweep's model family (its depth and head size, the width nearest N*), the tokens
C / 6N that shape gets, LR and batch from their laws, and the loss predicted at that shape with a
bootstrap prediction interval. `plan_for_model` predicts a run whose shape and tokens are given
(the validate run; a production run with explicit values). Both are plain dicts: they go into
`plan.json` and `kiln plan --budget` prints them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tasks.scaling.fit import hyper_at
from tasks.scaling.sweep import SweepConfig, TrialResult, model_at_width
from tasks.train.config import ModelConfig

if TYPE_CHECKING:
    from tasks.scaling.laws import HyperparameterLaws, IsoFlopFit, LossLawFit

MAX_WIDTH_HEADS = 512  # the family's widths considered: 1..512 heads of the proxy head size


def parameters(model: ModelConfig, vocab_size: int) -> int:
    """The law's N: every parameter, the embedding included (see `sweep.params_at_width`)."""
    from tasks.train.model import count_parameters

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


def predicted(law: LossLawFit | None, n: float, d: float) -> dict[str, Any]:
    if law is None:
        return {"predicted_loss": None, "interval": None}
    low, high = law.prediction_interval(n, d)
    return {"predicted_loss": float(law.predict(n, d)), "interval": [low, high], "level": law.level}


def plan_for_compute(compute: float, sweep: SweepConfig, vocab_size: int, law: LossLawFit | None,
                     isoflop: IsoFlopFit | None, hyper: HyperparameterLaws | None,
                     trials: Sequence[TrialResult]) -> dict[str, Any]:
    """The compute-optimal run for `compute` FLOPs in the sweep's model family.

    Raises ValueError when there is no loss law: without one there is no N*(C) to plan from.
    """
    if law is None:
        raise ValueError("no loss law was fitted (see the plan's refused.loss_law), so there is no compute-optimal "
                         "N and D to plan: give explicit model and steps, or sweep more (N, D) points")
    optimal = law.compute_optimal([compute])
    width = family_width(sweep, optimal.n_opt[0], vocab_size)
    model = model_at_width(sweep.model, width)
    n = parameters(model, vocab_size)
    tokens = compute / (6 * n)
    hp = hyper_at(hyper, trials, sweep, compute, width)
    seq = sweep.run.seq_len
    out = {
        "compute": compute, "n_opt": optimal.n_opt[0], "n_opt_interval": list(optimal.n_opt_interval[0]),
        "d_opt": optimal.d_opt[0], "d_opt_interval": list(optimal.d_opt_interval[0]),
        "n_exponent": optimal.n_exponent, "n_exponent_interval": list(optimal.n_exponent_interval),
        "width": width, "model": model.model_dump(mode="json"), "num_params": n, "tokens": round(tokens),
        "seq_len": seq, "batch_size": hp["batch_size"], "steps": max(1, round(tokens / (hp["batch_size"] * seq))),
        "lr": hp["lr"], "lr_interval": hp["lr_interval"], "batch_interval": hp["batch_interval"],
        "hyperparameters_from": hp["source"], **predicted(law, n, tokens),
    }
    low, high = isoflop.n_law.exponent_interval if isoflop is not None else (0.0, 0.0)
    if low > 0 or high < 0:  # Chinchilla approach 2 beside approach 3, when its minima show a trend
        out["isoflop_n_opt"] = float(isoflop.n_law.predict(compute))
        out["isoflop_d_opt"] = float(isoflop.d_law.predict(compute))
    return out


def plan_for_model(model: ModelConfig, tokens: int, batch_size: int, seq_len: int, sweep: SweepConfig,
                   vocab_size: int, law: LossLawFit | None, hyper: HyperparameterLaws | None,
                   trials: Sequence[TrialResult]) -> dict[str, Any]:
    """The prediction and hyper-parameters for a run of a given shape and token count."""
    n = parameters(model, vocab_size)
    compute = 6.0 * n * tokens
    hp = hyper_at(hyper, trials, sweep, compute, model.d_model)
    out = {"compute": compute, "model": model.model_dump(mode="json"), "num_params": n, "tokens": tokens,
           "seq_len": seq_len, "batch_size": batch_size, "steps": max(1, round(tokens / (batch_size * seq_len))),
           "lr": hp["lr"], "lr_interval": hp["lr_interval"], "planned_batch_size": hp["batch_size"],
           "hyperparameters_from": hp["source"], **predicted(law, n, tokens)}
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
    if run.get("predicted_loss") is not None:
        lo, hi = run["interval"]
        lines.append(f"  predicted loss {run['predicted_loss']:.4f}, {run['level']:.0%} prediction interval "
                     f"[{lo:.4f}, {hi:.4f}]")
    return "\n".join(lines)


def budget_report(cfg: Any, compute: float) -> tuple[str, dict[str, Any]]:
    """`kiln plan CONFIG --budget`: the compute-optimal run for `compute` FLOPs from the config's
    completed fit (and sweep) in the store; the report and the run as a dict."""
    from tasks.errors import KilnError
    from tasks.graph import stage_keys
    from tasks.scaling.fit import PLAN_FILE, laws_from_plan
    from tasks.scaling.sweep import TRIALS_FILE, load_trials
    from tasks.store import Store

    store, keys = Store(cfg.store_root), stage_keys(cfg)
    for stage in ("sweep", "fit"):
        if not store.is_complete(stage, keys[stage]):
            raise KilnError(f"no completed {stage} stage for this config in {cfg.store_root} (key {keys[stage]}): "
                            "run `kiln run CONFIG --until fit` first")
    plan = json.loads((store.path("fit", keys["fit"]) / PLAN_FILE).read_text())
    trials = load_trials(store.path("sweep", keys["sweep"]) / TRIALS_FILE)
    law, isoflop, hyper = laws_from_plan(plan)
    try:
        run = plan_for_compute(compute, cfg.sweep, plan["family"]["vocab_size"], law, isoflop, hyper, trials)
    except ValueError as error:
        raise KilnError(str(error)) from None
    lines = [describe(run, "compute-optimal run"), f"  mixture {plan['mixture']['name']} ({plan['mixture']['source']}): "
             + ", ".join(f"{d} {w:.3f}" for d, w in plan["mixture"]["weights"].items())]
    warnings = [w for w in plan["warnings"] if "interval" in w or "extrapolat" in w]
    lines += [f"  warning: {w}" for w in warnings]
    lines.append(f"  (fit {store.path('fit', keys['fit'])})")
    return "\n".join(lines) + "\n", run
