"""The trust measures on synthetic score series whose SNR and monotonicity are known."""

from __future__ import annotations

import math
import random

import pytest

from kiln.tasks.evals.trust import (
    LevelThresholds,
    TrustConfig,
    checkpoint_noise,
    decision_accuracy,
    decision_accuracy_by_key,
    judge,
    margin_above_random,
    measure,
    monotonicity,
    signal,
    snr,
    spearman,
)


def test_noise_signal_and_snr_of_a_known_series():
    # Last three checkpoints 0.50, 0.52, 0.48: standard deviation exactly 0.02.
    series = [(100, 0.30), (200, 0.40), (300, 0.50), (400, 0.52), (500, 0.48)]
    assert checkpoint_noise(series, 3) == pytest.approx(0.02)
    # Proxies spread 0.2 apart: SNR 10.
    assert signal([0.3, 0.5, 0.4]) == pytest.approx(0.2)
    assert snr(0.2, 0.02) == pytest.approx(10.0)
    assert snr(0.0, 0.0) is None and snr(0.1, 0.0) == math.inf


def test_snr_recovered_from_noisy_synthetic_scores():
    rng = random.Random(0)
    sigma, spread = 0.01, 0.3  # true SNR 30
    checkpoints = [(step, 0.6 + rng.gauss(0, sigma)) for step in range(0, 2000, 100)]
    models = [0.3, 0.45, 0.6]
    m = measure(checkpoints, True, k=20, models=models)
    assert m.signal == pytest.approx(spread)
    assert 20 < m.snr < 45  # the sample standard deviation of 20 draws is within ~30% of sigma
    # A larger standard error over the items is the noise instead.
    assert measure(checkpoints, True, k=20, models=models, item_stderr=0.1).snr == pytest.approx(3.0)


def test_monotonicity_is_spearman_signed_by_direction():
    rising = [(s, 0.1 * s) for s in range(10)]
    assert monotonicity(rising, True) == pytest.approx(1.0)
    assert monotonicity(rising, False) == pytest.approx(-1.0)  # a loss that rises is getting worse
    # One swap among 5 steps: rho = 1 - 6 * 2 / (5 * 24) = 0.9.
    assert spearman([1, 2, 3, 4, 5], [1, 2, 4, 3, 5]) == pytest.approx(0.9)
    assert spearman([1, 2, 3], [7, 7, 7]) is None and spearman([1, 2], [1, 2]) is None


def test_a_constant_task_is_not_trusted_even_without_other_measures():
    # The line-completion task of the default run: exact match 0.0 at every checkpoint.
    zeros = [(1000, 0.0), (2000, 0.0), (3000, 0.0), (4000, 0.0)]
    verdict = judge(measure(zeros, True, k=3, chance=0.0, models=[0.0, 0.0]), TrustConfig().production)
    assert not verdict.trusted
    assert any("same score at every checkpoint" in r for r in verdict.reasons)
    assert any("margin above random +0.000" in r for r in verdict.reasons)


def test_a_steady_well_separated_task_is_trusted_and_thresholds_bite():
    series = [(s, 0.25 + 0.05 * s) for s in range(6)]
    m = measure(series, True, k=3, models=[0.3, 0.6], chance=0.25)
    assert m.monotonicity == pytest.approx(1.0) and m.margin == pytest.approx(0.25)
    assert judge(m, TrustConfig().mid).trusted
    strict = judge(m, LevelThresholds(min_snr=1e6))
    assert not strict.trusted and strict.reasons[0].startswith("SNR")


def test_margin_and_decision_accuracy():
    assert margin_above_random(0.3, 0.25, True) == pytest.approx(0.05)
    assert margin_above_random(0.4, 0.5, False) == pytest.approx(0.1)  # e.g. stereotype preference below 0.5
    assert margin_above_random(2.0, None, False) is None
    small = {"a": 1.0, "b": 2.0, "c": 3.0}
    assert decision_accuracy(small, {"a": 10.0, "b": 20.0, "c": 30.0}) == 1.0
    assert decision_accuracy(small, {"a": 10.0, "b": 30.0, "c": 20.0}) == pytest.approx(2 / 3)
    assert decision_accuracy(small, {"a": 1.0}) is None


def test_decision_accuracy_per_task_on_synthetic_rankings_with_a_known_answer():
    # Four mixtures (6 pairs). At the large size bits per byte orders them m1 < m2 < m3 < m4 on both tasks.
    large = {m: {"prose/bits_per_byte": v, "code/bits_per_byte": v + 1} for m, v in
             (("m1", 2.0), ("m2", 2.1), ("m3", 2.2), ("m4", 2.3))}
    # The small size: "prose" keeps the whole order (6 of 6 pairs); "code" swaps m1 and m2 and m3 and m4
    # (4 of 6 pairs hold); "choice" is scored at one size only (no decision); m5 ran small only (left out).
    small = {"m1": {"prose/bits_per_byte": 3.0, "code/bits_per_byte": 4.1, "choice/acc": 0.3},
             "m2": {"prose/bits_per_byte": 3.2, "code/bits_per_byte": 4.0, "choice/acc": 0.4},
             "m3": {"prose/bits_per_byte": 3.3, "code/bits_per_byte": 4.6, "choice/acc": 0.5},
             "m4": {"prose/bits_per_byte": 3.9, "code/bits_per_byte": 4.5, "choice/acc": 0.6},
             "m5": {"prose/bits_per_byte": 1.0, "code/bits_per_byte": 1.0}}
    assert decision_accuracy_by_key(small, large) == {"prose/bits_per_byte": 1.0, "code/bits_per_byte": 4 / 6}
    # A fully reversed small-scale ranking: every decision wrong.
    reversed_small = {m: {"prose/bits_per_byte": -v["prose/bits_per_byte"]} for m, v in large.items()}
    assert decision_accuracy_by_key(reversed_small, large) == {"prose/bits_per_byte": 0.0}
    # Random rankings of 8 mixtures agree on about half the pairs (28 pairs a draw, 200 draws).
    rng = random.Random(0)
    names = [f"m{i}" for i in range(8)]
    big = {m: {"t/acc": float(i)} for i, m in enumerate(names)}
    shares = [decision_accuracy_by_key({m: {"t/acc": rng.random()} for m in names}, big)["t/acc"] for _ in range(200)]
    assert abs(sum(shares) / len(shares) - 0.5) < 0.03
