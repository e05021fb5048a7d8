"""Validate: the mid-scale gate between the fit's plan and the production run.

A run beyond the sweep's compute trains with the plan's learning rate and mixture; the gate passes
only if its loss stayed finite and fell, the run had no more than `max_spikes` loss spikes and
no gradient-norm blow-up, and the validation loss of the run at this size on the law's mixture
(this run, or the transfer run on the reference mixture when the plan chose another: `law_run`)
lies in the fit's bootstrap prediction interval (no floor: a law that does not transfer fails
here). Beside the loss, the mid-scale model's eval-suite scores must continue the proxies' trend
(`capabilities`), and the mixture regression's ranking is checked at the validate size
(`transfer`). The validate stage records the report; the train stage refuses to start on a failed
gate unless `train.gate_override` gives a reason, which is recorded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.errors import KilnError
from kiln.tasks.scaling.capabilities import CapabilityConfig, CapabilityRow
from kiln.tasks.scaling.transfer import MixtureTransferConfig
from kiln.tasks.train.config import ModelConfig, TrainRunConfig

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
    capabilities: CapabilityConfig = Field(CapabilityConfig(), description="the eval suite beside the proxies' trend")
    mixture_transfer: MixtureTransferConfig = Field(
        MixtureTransferConfig(), description="the mixture regression's ranking, checked at the validate model's size")


class ValidationGateError(KilnError):
    """The mid-scale run disagreed with the plan; the message is the gate report."""


@dataclass
class GateReport:
    passed: bool
    observed_val_loss: float
    predicted: dict[str, Any] | None  # loss, low, high, level, num_params, tokens
    reasons: list[str] = field(default_factory=list)  # why it failed (empty when it passed)
    checks: dict[str, Any] = field(default_factory=dict)  # every check's measured value
    capabilities: list[dict[str, Any]] = field(default_factory=list)  # CapabilityRow.as_dict() per metric
    mixture_transfer: dict[str, Any] | None = None  # predicted and observed losses, spearman
    # Each capability task's decision accuracy over the mixtures trained at both sizes: `mixtures`, `pairs`,
    # `by_task` ("task/metric" -> share of pairs ordered alike, None where the validate size ties them all).
    decision_accuracy: dict[str, Any] | None = None

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
        for row in self.capabilities:
            trend = ", ".join(f"{v:.4f} @ {c:.2g}" for _, c, v in row["proxies"])
            verdict = "continues" if row["continues"] else "BREAKS"
            decides = row["gated"] and row.get("trusted") is not False
            lines.append(f"  {row['metric']}: proxies {trend} FLOPs; mid-scale {row['midscale']:.4f} @ "
                         f"{row['midscale_compute']:.2g} ({verdict} the trend vs best proxy {row['best_proxy_value']:.4f}"
                         + (")" if decides else "; not gated)" if not row["gated"] else "; not trusted: decides nothing)")
                         + ("" if row["plan_mixture"] is None else f"; on the plan's mixture {row['plan_mixture']:.4f}"))
            if row.get("trusted") is False:
                lines.append(f"      not trusted: {'; '.join(row['trust']['reasons'])}")
        untrusted = [row["metric"] for row in self.capabilities if row["gated"] and row.get("trusted") is False]
        if untrusted:
            lines.append(f"  gated metrics of tasks not trusted at this size, left out of the gate: {', '.join(untrusted)}")
        transfer = self.mixture_transfer
        if transfer:
            if transfer.get("spearman") is None:
                lines.append(f"  mixture transfer: {transfer['note']}")
            else:
                lines.append(f"  mixture transfer at the validate size: Spearman {transfer['spearman']:.2f} over "
                             + ", ".join(f"{name} (pred {p:.4f}, obs {transfer['observed'][name]:.4f})"
                                         for name, p in transfer["predicted"].items() if name in transfer["observed"]))
        decisions = self.decision_accuracy
        if decisions and decisions["by_task"]:
            lines.append(f"  decision accuracy (the order of {len(decisions['mixtures'])} mixtures at the sweep's size "
                         f"holding at this size, {decisions['pairs']} pairs): "
                         + ", ".join(f"{key} {'–' if v is None else f'{v:.2f}'}" for key, v in decisions["by_task"].items()))
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


def check_gate(val_loss: float, loss_curve: list[tuple[int, float]], predicted: dict[str, Any] | None, *,
               health_events: list[dict[str, Any]] = (), grad_norm_curve: list[tuple[int, float]] = (),
               warmup_steps: int = 0, cfg: ValidateConfig | None = None,
               capabilities: tuple[list[CapabilityRow], list[str]] | None = None,
               mixture_transfer: dict[str, Any] | None = None, law_run: tuple[str, float] | None = None,
               decision_accuracy: dict[str, Any] | None = None) -> GateReport:
    """The gate's verdict. `capabilities` is `capability_trend`'s rows and reasons; `mixture_transfer`
    holds `predicted`, `observed` and `spearman` (None with a `note` when there is nothing to rank).
    `law_run` (name, val loss) is the run held to the interval when it is not this one: the run at
    this size on the mixture the law was fitted on."""
    cfg = cfg or ValidateConfig()
    reasons = []
    checks: dict[str, Any] = {}
    law_name, law_loss = law_run or ("validate", val_loss)
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
        checks["law_run"], checks["law_run_val_loss"] = law_name, law_loss
        checks["inside_interval"] = low <= law_loss <= high
        if not checks["inside_interval"]:
            side = "above" if law_loss > high else "below"
            reasons.append(
                f"observed loss {law_loss:.4f} ({law_name}) is {side} the {predicted['level']:.0%} prediction interval "
                f"[{low:.4f}, {high:.4f}]: the fitted law does not transfer to this size. Sweep closer to it (larger "
                "budgets, more widths), or, having read why, start production with train.gate_override")
    rows: list[CapabilityRow] = []
    if capabilities is not None:
        rows, capability_reasons = capabilities
        # A task not trusted at this size (`capabilities.row_trust`) decides nothing.
        checks["capabilities_continue"] = all(r.continues for r in rows if r.gated and r.trusted is not False)
        checks["capabilities_not_trusted"] = [r.metric for r in rows if r.gated and r.trusted is False]
        reasons += capability_reasons
    if mixture_transfer is not None:
        rho, floor = mixture_transfer.get("spearman"), cfg.mixture_transfer.min_spearman
        checks["mixture_transfer_spearman"] = None if rho is None else round(rho, 3)
        if floor is not None and (rho is None or rho < floor):
            got = "no rank correlation" if rho is None else f"rank correlation {rho:.2f}"
            reasons.append(f"the mixture regression's ranking does not transfer to the validate size: {got} between "
                           f"predicted and observed losses (validate.mixture_transfer.min_spearman={floor:g}); the "
                           "plan's mixture is chosen from a ranking that does not hold here")
    return GateReport(not reasons, val_loss, predicted, reasons, checks, [r.as_dict() for r in rows],
                      mixture_transfer, decision_accuracy)
