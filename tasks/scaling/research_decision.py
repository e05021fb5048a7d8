"""Research decisions: does a variant beat the baseline, and does its gain hold as the model grows?

Pure numbers (numpy, scipy.stats): the research stage (`tasks.scaling.research`) hands in each
variant's and the baseline's final validation losses per scale and seed, and gets back a decision
per variant. The rule (also in the README, "Research: small first, then scale"):

1. **Paired effect per scale.** Variant and baseline train on the same data in the same order for
   each seed, so the effect at a scale is the mean of the per-seed differences d = L_variant -
   L_baseline (negative: the variant is better), with a Student-t interval over the seeds.
2. **Trend to production.** d is regressed on log10(compute) over every (scale, seed) point
   (ordinary least squares) and evaluated at the production compute, with the t interval of the
   fitted mean there, and a two-sided p-value for "the effect at production size is zero".
3. **Several variants at once.** The p-values are Holm-corrected across the study's variants.
4. **Noise floor from the seeds.** The baseline's seed-to-seed standard deviation of the final
   loss (pooled over scales). A production run is one seed: an effect smaller than that spread is
   not one it would show, so it cannot promote or reject.
5. **Decision.** `promote` when the Holm-corrected p < alpha, the production interval lies below 0,
   |effect| there exceeds the noise floor, the largest measured scale's interval (at alpha: a check
   that the measurement agrees with the trend, not a second test to correct; Bonferroni over 3 seeds
   asked for t = 9 at 2 degrees of freedom and missed a -0.22 +- 0.06 gain) lies below 0 too, and there is no crossover: a gain is
   promoted only when it is measured where the study comes closest to production and the trend
   carries it there. `reject` when the production interval lies above 0 (significant, beyond the
   floor), or the largest measured scale's interval lies above 0 by more than the floor (a handicap
   measured is not undone by a trend that only extrapolates it away). Else `inconclusive`.
   **Crossover warning**: a measured scale whose interval excludes 0 on the other side of the
   extrapolated effect (it helps small and hurts large, or the trend crosses zero before production
   size), or two measured scales significant in opposite directions. It blocks a promotion; confirm
   at a larger proxy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats

Decision = str  # "promote", "reject" or "inconclusive"


@dataclass(frozen=True)
class Interval:
    mean: float
    ci_low: float
    ci_high: float

    def excludes_zero(self) -> int:
        """+1 when the interval lies above 0, -1 below, 0 when it holds 0."""
        return 1 if self.ci_low > 0 else -1 if self.ci_high < 0 else 0


@dataclass(frozen=True)
class ScaleRuns:
    """One scale of a variant: the baseline's compute there and the paired final losses by seed."""

    compute: float  # the baseline's training FLOPs at this scale (6 N D): the gap's x axis
    variant: Mapping[int, float]  # seed -> final validation loss
    baseline: Mapping[int, float]

    def differences(self) -> list[float]:
        """Variant minus baseline for every seed both finished."""
        return [self.variant[s] - self.baseline[s] for s in sorted(set(self.variant) & set(self.baseline))]


@dataclass
class VariantDecision:
    decision: Decision
    effect_by_scale: dict[str, dict[str, float]]
    extrapolated: dict[str, float]
    p_value: float
    p_holm: float
    crossover: bool
    reasons: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return asdict(self)


def paired_interval(differences: Sequence[float], alpha: float) -> Interval:
    """The mean paired difference with its two-sided (1 - alpha) Student-t interval over the seeds."""
    d = np.asarray(differences, dtype=float)
    if len(d) < 2:
        raise ValueError(f"a paired interval needs at least 2 seeds, got {len(d)}")
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    half = float(stats.t.ppf(1 - alpha / 2, len(d) - 1)) * se
    return Interval(mean, mean - half, mean + half)


@dataclass(frozen=True)
class Trend:
    """The gap against log10(compute): d = intercept + slope * log10(C)."""

    intercept: float
    slope: float
    at_target: Interval
    p_value: float

    def at(self, compute: float) -> float:
        return self.intercept + self.slope * math.log10(compute)


def gap_trend(computes: Sequence[float], differences: Sequence[float], target: float, alpha: float) -> Trend:
    """OLS of the differences on log10(compute), evaluated at `target` with the t interval of the fitted
    mean and the two-sided p-value of "it is zero there". Needs at least 2 distinct computes and 3 points."""
    x, y = np.log10(np.asarray(computes, dtype=float)), np.asarray(differences, dtype=float)
    if len(set(x.tolist())) < 2 or len(x) < 3:
        raise ValueError(f"a trend needs at least 2 distinct computes and 3 points, got {len(set(x.tolist()))} and {len(x)}")
    n, mean_x = len(x), float(x.mean())
    sxx = float(((x - mean_x) ** 2).sum())
    slope = float(((x - mean_x) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * mean_x)
    residual = y - (intercept + slope * x)
    variance = float((residual ** 2).sum() / (n - 2))
    xt = math.log10(target)
    mean = intercept + slope * xt
    se = math.sqrt(variance * (1 / n + (xt - mean_x) ** 2 / sxx))
    tq = float(stats.t.ppf(1 - alpha / 2, n - 2))
    if se == 0:  # every point on the line (a variant identical to the baseline): no doubt either way
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean) / se, n - 2))
    return Trend(intercept, slope, Interval(mean, mean - tq * se, mean + tq * se), p)


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm-Bonferroni adjusted p-values (step-down, made monotone, capped at 1)."""
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    adjusted, running = {}, 0.0
    for rank, (name, p) in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * p))
        adjusted[name] = running
    return adjusted


def noise_floor(baseline_by_scale: Mapping[str, Mapping[int, float]]) -> float:
    """The baseline's seed-to-seed standard deviation of the final loss, pooled over scales (the root
    of the mean per-scale variance, each with ddof=1)."""
    variances = [float(np.var(list(losses.values()), ddof=1)) for losses in baseline_by_scale.values()
                 if len(losses) >= 2]
    if not variances:
        raise ValueError("the noise floor needs at least 2 baseline seeds at some scale")
    return math.sqrt(sum(variances) / len(variances))


def decide(variants: Mapping[str, Mapping[str, ScaleRuns]], production_compute: float, floor: float,
           alpha: float = 0.05) -> dict[str, VariantDecision]:
    """Each variant's decision (see the module docstring) from its scales' paired runs."""
    effects: dict[str, dict[str, Interval]] = {}
    trends: dict[str, Trend] = {}
    for name, scales in variants.items():
        effects[name] = {s: paired_interval(runs.differences(), alpha) for s, runs in scales.items()
                         if len(runs.differences()) >= 2}
        computes = [runs.compute for runs in scales.values() for _ in runs.differences()]
        diffs = [d for runs in scales.values() for d in runs.differences()]
        trends[name] = gap_trend(computes, diffs, production_compute, alpha)
    adjusted = holm({name: trend.p_value for name, trend in trends.items()})
    out = {}
    for name, trend in trends.items():
        at = trend.at_target
        reasons = []
        side = at.excludes_zero()
        significant = adjusted[name] < alpha
        material = abs(at.mean) > floor
        largest_scale = max(variants[name], key=lambda s: variants[name][s].compute)
        largest_diffs = variants[name][largest_scale].differences()
        largest = paired_interval(largest_diffs, alpha) if len(largest_diffs) >= 2 else None
        largest_side = largest.excludes_zero() if largest else 0
        measured = {s: i.excludes_zero() for s, i in effects[name].items()}
        signs = {v for v in measured.values() if v}
        opposite = [s for s, v in measured.items() if v and at.mean and v != (1 if at.mean > 0 else -1)]
        crossover = len(signs) == 2 or bool(opposite)
        if not significant:
            reasons.append(f"Holm-corrected p = {adjusted[name]:.3g} at production size is not below alpha = {alpha}")
        elif not side:
            reasons.append("the interval at production size holds 0")
        if not material:
            reasons.append(f"|effect| {abs(at.mean):.4g} at production size is within the noise floor {floor:.4g}")
        if crossover:
            reasons.append("crossover: " + (f"the effect at {', '.join(opposite)} has the opposite sign of the "
                                            "extrapolated one" if opposite else
                                            "measured scales are significant in opposite directions"))
        if significant and material and side < 0 and largest_side < 0 and not crossover:
            decision = "promote"
        elif (significant and material and side > 0) or (largest and largest_side > 0 and largest.mean > floor):
            decision = "reject"
            if side <= 0:
                reasons.append(f"it hurts at the largest measured scale {largest_scale}")
        else:
            decision = "inconclusive"
            if significant and material and side < 0 and largest_side >= 0:
                reasons.append(f"no significant gain measured at the largest scale {largest_scale}")
        out[name] = VariantDecision(
            decision, {s: asdict(i) for s, i in effects[name].items()},
            {**asdict(at), "compute": production_compute, "slope_per_decade": trend.slope},
            trend.p_value, adjusted[name], crossover, reasons)
    return out
