"""The research decision on synthetic effects with known answers: a real gain promotes, a real loss
rejects, a null or sub-noise effect is inconclusive, a gain that turns into a loss before production
is rejected with a crossover warning, and Holm's correction orders and bounds the p-values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.tasks.scaling.research_decision import (
    ScaleRuns,
    decide,
    gap_trend,
    holm,
    noise_floor,
    paired_interval,
)

COMPUTES = {"s1": 1e8, "s2": 1e9, "s3": 1e10}
PRODUCTION = 1e12
SEEDS = 3


def baseline(seed_noise: float = 0.02) -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(0)
    return {s: {k: 4.0 - 0.3 * math.log10(c / 1e8) + seed_noise * float(rng.normal()) for k in range(SEEDS)}
            for s, c in COMPUTES.items()}


def variant(base: dict[str, dict[int, float]], effect, jitter: float = 0.002, seed: int = 1
            ) -> dict[str, ScaleRuns]:
    """The baseline's losses plus `effect(log10 compute)` and a small paired jitter."""
    rng = np.random.default_rng(seed)
    return {s: ScaleRuns(COMPUTES[s], {k: v + effect(math.log10(COMPUTES[s])) + jitter * float(rng.normal())
                                       for k, v in base[s].items()}, base[s]) for s in COMPUTES}


def test_paired_interval_is_the_student_t_interval():
    interval = paired_interval([0.1, 0.2, 0.3], alpha=0.05)
    assert interval.mean == pytest.approx(0.2)
    # sd 0.1, se 0.1/sqrt(3), t(0.975, 2) = 4.302653
    assert interval.ci_high - interval.mean == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 seeds"):
        paired_interval([0.1], alpha=0.05)


def test_gap_trend_recovers_a_known_line_and_its_zero_interval():
    trend = gap_trend([1e8, 1e9, 1e10], [-0.3, -0.2, -0.1], 1e12, alpha=0.05)
    assert trend.slope == pytest.approx(0.1)
    assert trend.at_target.mean == pytest.approx(0.1)
    assert trend.at_target.ci_low == pytest.approx(0.1) and trend.p_value < 1e-12
    with pytest.raises(ValueError, match="2 distinct computes"):
        gap_trend([1e8, 1e8, 1e8], [0.0, 0.1, 0.2], 1e12, alpha=0.05)


def test_holm_matches_a_hand_computed_example():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})


def test_noise_floor_is_the_pooled_seed_spread():
    assert noise_floor({"s1": {0: 1.0, 1: 1.2}, "s2": {0: 2.0, 1: 2.0}}) == pytest.approx(math.sqrt(0.02 / 2))


def test_known_effects_get_their_known_decisions():
    base = baseline()
    floor = noise_floor(base)
    variants = {
        "gain": variant(base, lambda x: -0.15),
        "loss": variant(base, lambda x: +0.15, seed=2),
        "null": variant(base, lambda x: 0.0, seed=3),
        "tiny": variant(base, lambda x: -0.004, jitter=0.0005, seed=4),  # real, but below the seed spread
        # helps by 0.2 at 1e8, 0 at 1e10, hurts by 0.2 at production (1e12)
        "cross": variant(base, lambda x: -0.2 + 0.1 * (x - 8), seed=5),
        "same": {s: ScaleRuns(COMPUTES[s], dict(base[s]), base[s]) for s in COMPUTES},
    }
    out = decide(variants, PRODUCTION, floor, alpha=0.05)
    assert floor > 0.004
    assert out["gain"].decision == "promote" and not out["gain"].crossover
    assert out["gain"].extrapolated["ci_high"] < 0
    assert out["loss"].decision == "reject" and not out["loss"].crossover
    assert out["null"].decision == "inconclusive"
    assert out["tiny"].decision == "inconclusive"
    assert any("noise floor" in r for r in out["tiny"].reasons)
    assert out["cross"].decision == "reject" and out["cross"].crossover
    assert out["cross"].effect_by_scale["s1"]["ci_high"] < 0  # it helped at the smallest scale
    assert out["same"].decision == "inconclusive" and out["same"].p_value == 1.0
    assert set(out["gain"].effect_by_scale) == set(COMPUTES)
    # Holm: each adjusted p-value is at least its raw one
    assert all(d.p_holm >= d.p_value for d in out.values())
