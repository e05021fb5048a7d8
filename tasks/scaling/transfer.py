"""Mixture transfer: does the mixture regression's ranking, learnt from small proxies, hold for a
larger model?

RegMix's claim (rank correlation ~0.9 between proxy-scale predictions and larger runs) is what
makes choosing a mixture from proxies worth anything, and it is checkable: the fit records the
regression's predicted loss for its recommendation and every mixture trial; validate trains a few
of them at the validate model's size (the plan's mixture, the reference, the predicted best and
worst, and evenly spaced ones between) and the gate reports the Spearman correlation between the
predicted and the observed order.

The loss law is fitted on the reference mixture, so its prediction holds for a run on that
mixture: at the validate run's length the reference's transfer run is the one held to the law's
interval and compared with the proxies (trained on it too) on the eval suite, while the validate
run (on the plan's mixture, often a better one) checks stability.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pydantic import Field, model_validator
from scipy import stats

from kiln.tasks.configbase import Section


class MixtureTransferConfig(Section):
    num_mixtures: int = Field(
        4, ge=0, description="mixtures at the validate model's size (0: no check): the plan's (the validate run), "
        "the reference, the predicted best and worst, and evenly spaced ones between (a rank correlation needs 3)")
    steps: int | None = Field(
        None, ge=1, description="each one's steps, at the validate run's batch and context (null: validate.run.steps: "
        "then the run on the reference mixture is the one the law's interval is checked on, and the validate run "
        "itself is the plan mixture's)")
    min_spearman: float | None = Field(
        None, ge=-1, le=1, description="the gate fails below this rank correlation; null: reported only (with 4 "
        "mixtures one swapped pair moves it by 0.2)")

    @model_validator(mode="after")
    def _check(self) -> MixtureTransferConfig:
        if self.num_mixtures in (1, 2):
            raise ValueError(f"validate.mixture_transfer.num_mixtures={self.num_mixtures}: a rank correlation needs "
                             "at least 3 mixtures (0 turns the check off)")
        return self


def choose_transfer_mixtures(predicted: Mapping[str, float], always: Sequence[str], num: int) -> list[str]:
    """`num` of the predicted mixtures, in predicted order (best first): those of `always` that are
    predicted (the plan's mixture, the reference), the predicted best and worst, then evenly spaced
    in predicted rank among the rest."""
    order = sorted(predicted, key=lambda name: (predicted[name], name))
    if num >= len(order):
        return order
    chosen: list[str] = []
    for name in [*always, order[0], order[-1]]:
        if name in predicted and name not in chosen and len(chosen) < num:
            chosen.append(name)
    rest = [name for name in order if name not in chosen]
    need = num - len(chosen)
    if need:
        step = (len(rest) - 1) / max(need - 1, 1)
        picks = [round(i * step) for i in range(need)] if need > 1 else [len(rest) // 2]
        chosen += [rest[i] for i in picks]
    return sorted(chosen, key=order.index)


def transfer_spearman(predicted: Mapping[str, float], observed: Mapping[str, float]) -> float | None:
    """Spearman's rank correlation between predicted and observed losses over the mixtures both
    name; None when fewer than 3 or either side is constant (no order to compare)."""
    names: Sequence[str] = sorted(set(predicted) & set(observed))
    x, y = [predicted[n] for n in names], [observed[n] for n in names]
    if len(names) < 3 or len(set(x)) == 1 or len(set(y)) == 1:
        return None
    rho = float(stats.spearmanr(x, y).statistic)
    return rho if math.isfinite(rho) else None
