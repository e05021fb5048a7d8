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

Only a trusted task decides the gate. Each row's trust is measured on the models the gate has
(`tasks.evals.trust`, the thresholds of the task's level in `validate.capabilities.trust`): the signal is the
spread of the proxies' scores, the noise the standard error of one score over its items (the
largest over the proxies and the mid-scale model), monotonicity the Spearman of the proxies' scores
against compute, the margin the best proxy's above chance; a task whose proxies all score the same
cannot tell models apart. A gated metric of a task not trusted is reported with its reasons and
decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from kiln.tasks.configbase import Section, added_field
from kiln.tasks.evals.suite import PRIMARY_METRICS, primary_metric
from kiln.tasks.evals.trust import Measures, TrustConfig, Verdict, judge, margin_above_random, monotonicity, signal, snr


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
    trust: TrustConfig = added_field(
        TrustConfig(), description="thresholds per level (as evaluate.trust's) under which a task is not trusted at "
        "the gate: measured on the proxies (signal: their spread; noise: a score's standard error over its items; "
        "monotonicity: Spearman against compute); its gated metrics are reported and decide nothing (last_k unused)")


@dataclass(frozen=True)
class ScoredModel:
    """A model's eval-suite scores (`"task/metric": value`) and its training compute (6·N·D)."""

    name: str
    compute: float
    metrics: dict[str, float]
    # Of each task (by name), what its results say beyond the score: `level`, `stderr` (the score's
    # standard error over its items) and `chance` (`capability_items`); empty: trust is not judged.
    items: dict[str, dict[str, Any]] = field(default_factory=dict)


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
    trusted: bool | None = None  # None: not judged (no item scores); False: reported, decides nothing
    trust: dict[str, Any] | None = None  # the verdict: reasons and measures (`Verdict.to_json`)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def primary_metrics(metrics: dict[str, float]) -> list[str]:
    """Each task's primary metric (`PRIMARY_METRICS`) among flat `"task/metric"` keys, in task order."""
    by_task: dict[str, list[str]] = {}
    for key in metrics:
        task, _, metric = key.partition("/")
        by_task.setdefault(task, []).append(metric)
    return [f"{task}/{m}" for task, names in by_task.items() if (m := primary_metric(names)) is not None]


def capability_items(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each local task's `level`, `stderr` (the bootstrap 95 % interval's half-width / 1.96) and `chance`,
    from an evaluation's results.json (`evaluate.evaluate_lm`)."""
    out = {}
    for task, info in results.get("kiln_tasks", {}).items():
        item = results.get("kiln_item_scores", {}).get(task, {})
        low, high = item.get("ci_low"), item.get("ci_high")
        out[task] = {"level": info["level"], "chance": item.get("chance"),
                     "stderr": None if low is None or high is None else (high - low) / (2 * 1.96)}
    return out


def row_trust(key: str, points: Sequence[tuple[str, float, float]], models: Sequence[ScoredModel],
              trust: TrustConfig) -> Verdict | None:
    """The trust of one capability row (`key`: "task/metric") at the gate, from the proxies' scores by compute
    (`points`) and what `models` (the proxies and the mid-scale model) say of the task's items; None when they
    lack its level (not judged)."""
    task, _, metric = key.partition("/")
    infos = [m.items[task] for m in models if task in m.items]
    if not infos:
        return None
    higher = PRIMARY_METRICS[metric]
    values = [v for _, _, v in points]
    errors = [i["stderr"] for i in infos if i.get("stderr") is not None]
    noise = max(errors) if errors else None
    spread = signal(values)
    best = (max if higher else min)(values)
    measures = Measures(noise=noise, signal=spread, snr=snr(spread, noise),
                        monotonicity=monotonicity([(c, v) for _, c, v in points], higher),
                        margin=margin_above_random(best, infos[0].get("chance"), higher),
                        constant=len(values) >= 2 and len(set(values)) == 1)
    verdict = judge(measures, getattr(trust, infos[0]["level"]))
    reasons = [r.replace("vs step", "vs compute").replace("at every checkpoint", "on every proxy") for r in verdict.reasons]
    return Verdict(verdict.trusted, reasons, measures)


def capability_trend(proxies: Sequence[ScoredModel], midscale: ScoredModel, cfg: CapabilityConfig,
                     plan_model: ScoredModel | None = None, trust: TrustConfig | None = None
                     ) -> tuple[list[CapabilityRow], list[str]]:
    """One row per primary metric the mid-scale model and every proxy report; the reasons the gate
    fails (a gated metric of a trusted task worse than the best proxy's beyond the tolerance). Given
    `trust` (the thresholds per level) and the models' `items`, each row is judged (`row_trust`); a task
    not trusted is reported and decides nothing. `plan_model`, the mid-scale model on the plan's
    mixture, is reported beside it, never gated."""
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
        verdict = None if trust is None else row_trust(key, points, [*ordered, midscale], trust)
        rows.append(CapabilityRow(key, higher, points, value, midscale.compute, best[0], best[2], slope, at_mid,
                                  gated, continues, None if other is None else float(other),
                                  None if verdict is None else verdict.trusted,
                                  None if verdict is None else verdict.to_json()))
        if gated and not continues and (verdict is None or verdict.trusted):
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
