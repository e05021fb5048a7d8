"""Emerging capabilities at the gate: the eval suite's scores of the sweep's proxies against
compute, and whether the mid-scale (validate) model continues their trend.

A loss law can transfer while what the loss buys does not (a tokenizer, data or context problem
that only shows at size), so validate scores a mid-scale model and the best proxy of each IsoFLOP
budget on the same tasks (the evaluate stage's suite, a few items each). The mid-scale model
compared is the one trained on the proxies' (reference) mixture: another mixture moves per-domain
scores by itself (less prose, worse prose bits per byte), which is not a trend. The model on the
plan's mixture is shown beside it. Each task's primary metric is a
row: the proxies' values by compute, their trend (a straight line in log10 compute, the value it
extrapolates to at the mid-scale compute), and the mid-scale value. A *gated* metric fails the
gate when the mid-scale model, with more compute than any proxy, scores worse than the best proxy
by more than `tolerance` (relative): more compute that buys less is a broken trend. The best
proxy, not the extrapolation, is the bar: three proxies on a few items give a slope whose error
is as large as the slope. Accuracies on a few items are too coarse to gate (one item is 10 % at
limit 10), so by default only bits per byte is; the others are shown as trends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.evals.suite import PRIMARY_METRICS, primary_metric


class CapabilityConfig(Section):
    enabled: bool = Field(True, description="score the validate model and the sweep's best proxies on the eval suite")
    limit: int | None = Field(10, gt=0, description="items per task (null: all): enough to see a trend, cheap")
    tasks: list[str] = Field([], description="the suite's local tasks to score ([]: every one)")
    gated_metrics: list[str] = Field(
        ["bits_per_byte"], description="metrics on which the mid-scale model must be no worse than the best proxy "
        "(the others are reported as trends)")
    tolerance: float = Field(
        0.01, ge=0, description="relative slack of the gated comparison: in the default run one IsoFLOP budget step "
        "(2x compute) moves the proxies' prose bits per byte by 1.0-2.6 %, and one run's loss moves by ~1.3 % "
        "with its initialisation seed (the mid-scale run's and the best proxy's alike), so configs/default.yaml "
        "sets 3 %")


@dataclass(frozen=True)
class ScoredModel:
    """A model's eval-suite scores (`"task/metric": value`) and its training compute (6·N·D)."""

    name: str
    compute: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class CapabilityRow:
    metric: str  # "task/metric"
    higher_is_better: bool
    proxies: list[tuple[str, float, float]]  # (name, compute, value), ascending compute
    midscale: float
    midscale_compute: float
    best_proxy: str
    best_proxy_value: float
    slope_per_decade: float | None  # the proxies' least-squares line in log10 compute (None: one compute)
    trend_at_midscale: float | None  # that line at the mid-scale compute
    gated: bool
    continues: bool  # no worse than the best proxy within the tolerance
    plan_mixture: float | None = None  # the mid-scale model on the plan's mixture, when that is another one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def primary_metrics(metrics: dict[str, float]) -> list[str]:
    """Each task's primary metric (`PRIMARY_METRICS`) among flat `"task/metric"` keys, in task order."""
    by_task: dict[str, list[str]] = {}
    for key in metrics:
        task, _, metric = key.partition("/")
        by_task.setdefault(task, []).append(metric)
    return [f"{task}/{m}" for task, names in by_task.items() if (m := primary_metric(names)) is not None]


def capability_trend(proxies: Sequence[ScoredModel], midscale: ScoredModel, cfg: CapabilityConfig,
                     plan_model: ScoredModel | None = None) -> tuple[list[CapabilityRow], list[str]]:
    """One row per primary metric the mid-scale model and every proxy report; the reasons the gate
    fails (a gated metric worse than the best proxy's beyond the tolerance). `plan_model`, the
    mid-scale model on the plan's mixture, is reported beside it, never gated."""
    rows, reasons = [], []
    ordered = sorted(proxies, key=lambda p: p.compute)
    for key in primary_metrics(midscale.metrics):
        if not ordered or any(key not in p.metrics for p in ordered):
            continue
        metric = key.partition("/")[2]
        higher = PRIMARY_METRICS[metric]
        points = [(p.name, p.compute, float(p.metrics[key])) for p in ordered]
        best = (max if higher else min)(points, key=lambda row: row[2])
        value = float(midscale.metrics[key])
        slack = cfg.tolerance * abs(best[2])
        continues = value >= best[2] - slack if higher else value <= best[2] + slack
        slope, at_mid = _trend(points, midscale.compute)
        gated = metric in cfg.gated_metrics
        other = plan_model.metrics.get(key) if plan_model is not None else None
        rows.append(CapabilityRow(key, higher, points, value, midscale.compute, best[0], best[2], slope, at_mid,
                                  gated, continues, None if other is None else float(other)))
        if gated and not continues:
            word = "lower" if higher else "higher"
            reasons.append(
                f"{key} of the mid-scale model is {value:.4f}, {word} (worse) than the best proxy's {best[2]:.4f} "
                f"({best[0]}) with {midscale.compute / best[1]:.1f}x its compute (validate.capabilities.tolerance="
                f"{cfg.tolerance:g}): the proxies' capability trend does not continue at this size; look for "
                "what the larger model sees differently (context, tokenizer, data) before production")
    return rows, reasons


def _trend(points: Sequence[tuple[str, float, float]], compute: float) -> tuple[float | None, float | None]:
    x = np.log10([c for _, c, _ in points])
    if np.ptp(x) == 0:
        return None, None
    slope, intercept = np.polyfit(x, [v for _, _, v in points], 1)
    return float(slope), float(slope * math.log10(compute) + intercept)
