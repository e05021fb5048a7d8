"""Validate: the mid-scale gate between the fit's plan and the production run.

A model larger than any proxy trains with the plan's learning rate and mixture on the same
token budget as the sweep; the gate passes only if its loss is finite, it learned (final
train loss below the first logged loss), and its validation loss lies in the fit's
prediction interval. Otherwise the pipeline stops with a report instead of burning the
production budget on a bad plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import Field

from tasks.configbase import Section
from tasks.errors import KilnError
from tasks.train.config import ModelConfig

REPORT_FILE = "gate.json"


def _default_validate_model() -> ModelConfig:
    return ModelConfig(d_model=128, n_layers=2, n_heads=8, max_seq_len=64)


class ValidateConfig(Section):
    model: ModelConfig = Field(default_factory=_default_validate_model, description="the mid-scale model")
    enforce: bool = Field(True, description="stop the pipeline when the gate fails (false: report only)")


class ValidationGateError(KilnError):
    """The mid-scale run disagreed with the plan; the message is the gate report."""


@dataclass
class GateReport:
    passed: bool
    observed_val_loss: float
    predicted: dict[str, float] | None
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        head = "validation gate PASSED" if self.passed else "validation gate FAILED"
        lines = [f"{head}: observed val loss {self.observed_val_loss:.4f}"]
        if self.predicted:
            p = self.predicted
            lines.append(f"  predicted {p['loss']:.4f} in [{p['low']:.4f}, {p['high']:.4f}] for {p['num_params']} params")
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


def check_gate(val_loss: float, loss_curve: list[tuple[int, float]], predicted: dict[str, float] | None) -> GateReport:
    reasons = []
    if not math.isfinite(val_loss) or any(not math.isfinite(loss) for _, loss in loss_curve):
        reasons.append("loss became NaN/Inf: the plan's learning rate is unstable at this size")
    elif loss_curve and loss_curve[-1][1] >= loss_curve[0][1]:
        reasons.append(f"training loss did not decrease ({loss_curve[0][1]:.4f} → {loss_curve[-1][1]:.4f})")
    if predicted is None:
        # Too few sweep widths for a scaling law: only stability can be checked.
        return GateReport(not reasons, val_loss, None, reasons)
    if not predicted["low"] <= val_loss <= predicted["high"]:
        side = "above" if val_loss > predicted["high"] else "below"
        reasons.append(
            f"observed loss is {side} the prediction interval: the scaling fit does not transfer to this size — "
            "widen the sweep (more widths or steps), or relax fit.interval_sigmas / fit.min_relative_interval"
        )
    return GateReport(not reasons, val_loss, predicted, reasons)
