"""Validate: the mid-scale gate between the fit's plan and the production run.

A run beyond the sweep's compute trains with the plan's learning rate and mixture; the gate passes
only if its loss stayed finite and fell, the run had no more than `max_spikes` loss spikes and
no gradient-norm blow-up, and its validation loss lies in the fit's bootstrap prediction
interval (no floor: a law that does not transfer fails here). The validate stage records the
report; the train stage refuses to start on a failed gate unless `train.gate_override` gives a
reason, which is recorded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

from pydantic import Field

from tasks.configbase import Section
from tasks.errors import KilnError
from tasks.train.config import ModelConfig, TrainRunConfig

REPORT_FILE = "gate.json"


def _default_validate_model() -> ModelConfig:
    return ModelConfig(d_model=12, n_layers=2, n_heads=6, max_seq_len=64)


def _default_validate_run() -> TrainRunConfig:
    return TrainRunConfig(steps=232, batch_size=8, seq_len=64, eval_batches=4, checkpoint_every=500)


class ValidateConfig(Section):
    model: ModelConfig = Field(default_factory=_default_validate_model, description="the mid-scale model")
    run: TrainRunConfig = Field(default_factory=_default_validate_run,
                                description="its steps, batch and context (the LR is the plan's)")
    max_spikes: int = Field(0, ge=0, description="loss spikes (health events) the gate tolerates")
    max_grad_norm_ratio: float = Field(
        20.0, gt=1, description="a gradient norm above this many times the run's median (after warmup) is a "
        "blow-up the gate fails")


class ValidationGateError(KilnError):
    """The mid-scale run disagreed with the plan; the message is the gate report."""


@dataclass
class GateReport:
    passed: bool
    observed_val_loss: float
    predicted: dict[str, Any] | None  # loss, low, high, level, num_params, tokens
    reasons: list[str] = field(default_factory=list)  # why it failed (empty when it passed)
    checks: dict[str, Any] = field(default_factory=dict)  # every check's measured value

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        head = "validation gate PASSED" if self.passed else "validation gate FAILED"
        lines = [f"{head}: observed val loss {self.observed_val_loss:.4f}"]
        if self.predicted:
            p = self.predicted
            lines.append(f"  predicted {p['loss']:.4f}, {p['level']:.0%} prediction interval [{p['low']:.4f}, "
                         f"{p['high']:.4f}] for N={p['num_params']:,}, D={p['tokens']:,}")
        else:
            lines.append("  no prediction to check (the fit refused the loss law; see the plan's refused)")
        lines.append("  checks: " + ", ".join(f"{k}={v}" for k, v in self.checks.items()))
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


def check_gate(val_loss: float, loss_curve: list[tuple[int, float]], predicted: dict[str, Any] | None, *,
               health_events: list[dict[str, Any]] = (), grad_norm_curve: list[tuple[int, float]] = (),
               warmup_steps: int = 0, cfg: ValidateConfig | None = None) -> GateReport:
    cfg = cfg or ValidateConfig()
    reasons = []
    checks: dict[str, Any] = {}
    if not math.isfinite(val_loss) or any(not math.isfinite(loss) for _, loss in loss_curve):
        reasons.append("loss became NaN/Inf: the plan's learning rate is unstable at this size")
    elif loss_curve and loss_curve[-1][1] >= loss_curve[0][1]:
        reasons.append(f"training loss did not decrease ({loss_curve[0][1]:.4f} → {loss_curve[-1][1]:.4f})")
    spikes = [e for e in health_events if e.get("kind") in ("spike", "nonfinite")]
    checks["num_spikes"] = len(spikes)
    if len(spikes) > cfg.max_spikes:
        reasons.append(f"{len(spikes)} loss spikes (validate.max_spikes={cfg.max_spikes}), first at step "
                       f"{spikes[0].get('step')}: the plan's LR or batch is unstable at this size")
    norms = [g for s, g in grad_norm_curve if s > warmup_steps and math.isfinite(g)]
    if norms:
        ratio = max(norms) / max(median(norms), 1e-12)
        checks["max_grad_norm_ratio"] = round(ratio, 2)
        if ratio > cfg.max_grad_norm_ratio:
            reasons.append(f"gradient norm reached {ratio:.1f}x its median after warmup (validate.max_grad_norm_ratio"
                           f"={cfg.max_grad_norm_ratio:g}): training was close to diverging")
    if predicted is not None:
        low, high = predicted["low"], predicted["high"]
        checks["inside_interval"] = low <= val_loss <= high
        if not checks["inside_interval"]:
            side = "above" if val_loss > high else "below"
            reasons.append(
                f"observed loss {val_loss:.4f} is {side} the {predicted['level']:.0%} prediction interval "
                f"[{low:.4f}, {high:.4f}]: the fitted law does not transfer to this size. Sweep closer to it (larger "
                "budgets, more widths), or, having read why, start production with train.gate_override")
    return GateReport(not reasons, val_loss, predicted, reasons, checks)
