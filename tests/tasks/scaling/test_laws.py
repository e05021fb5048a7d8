"""Scaling laws: known parameters recovered from synthetic data, refusals, and honest warnings.

Synthetic points come from Hoffmann et al.'s fitted law (E=1.69, A=406.4, B=410.7, α=0.34,
β=0.28) with N log-uniform over 1e7..1e10, D over 1e9..1e12 and multiplicative log-normal noise
σ=0.01. Tolerances are about 3 standard deviations of the estimator, measured over 20 seeds:
at 200 points sd(α)≈0.009, sd(β)≈0.010, sd(E)≈0.022 (so α, β ±0.03, E ±0.08); at 100 points
sd(α), sd(β)≈0.013 (so ±0.04). Over 40 seeds the 95% bootstrap intervals covered the truth in
95–100% of fits per parameter; here one seed is checked.
"""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from kiln.tasks.scaling.laws import (
    compute_optimal_allocation,
    fit_hyperparameter_laws,
    fit_isoflop_minima,
    fit_loss_law,
    fit_power_law,
    group_budgets,
)

TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def law(n, d):
    return TRUTH["E"] + TRUTH["A"] / n ** TRUTH["alpha"] + TRUTH["B"] / d ** TRUTH["beta"]


def synthetic(num_points, seed, sigma=0.01):
    rng = np.random.default_rng(seed)
    n = 10 ** rng.uniform(7, 10, num_points)
    d = 10 ** rng.uniform(9, 12, num_points)
    return n, d, law(n, d) * np.exp(rng.normal(0, sigma, num_points))


@pytest.fixture(scope="module")
def hoffmann_fit():
    return fit_loss_law(*synthetic(200, seed=0))


def test_loss_law_recovers_known_parameters_and_intervals_cover_them(hoffmann_fit):
    fit = hoffmann_fit
    assert fit.alpha == pytest.approx(TRUTH["alpha"], abs=0.03)
    assert fit.beta == pytest.approx(TRUTH["beta"], abs=0.03)
    assert fit.E == pytest.approx(TRUTH["E"], abs=0.08)
    for name, value in TRUTH.items():
        low, high = fit.intervals[name]
        assert low <= value <= high, f"{name}={value} outside its 95% interval [{low}, {high}]"
    assert fit.rmse_log == pytest.approx(0.01, abs=0.003)  # the noise level, no better, no worse
    assert len(fit.residuals) == 200 and fit.num_points == 200 and fit.dropped == ()
    assert fit.warnings == ()
    assert fit.bootstrap_params.shape == (200, 5)
    json.dumps(fit.as_dict())  # reports are JSON-ready


def test_gross_outliers_do_not_drag_the_exponents():
    n, d, loss = synthetic(100, seed=2)
    loss[:3] *= np.array([2.0, 0.5, 3.0])  # three runs that diverged or were logged wrongly
    robust = fit_loss_law(n, d, loss, num_bootstrap=0)
    assert robust.alpha == pytest.approx(TRUTH["alpha"], abs=0.04)
    assert robust.beta == pytest.approx(TRUTH["beta"], abs=0.04)
    # The outliers are gross enough to matter: least squares (a Huber δ beyond every residual) is dragged.
    least_squares = fit_loss_law(n, d, loss, huber_delta=10.0, num_bootstrap=0)
    assert abs(least_squares.beta - TRUTH["beta"]) > 0.1
    # The optional MAD rule drops exactly the injected points and says so.
    trimmed = fit_loss_law(n, d, loss, outlier_mad_k=5.0, num_bootstrap=20)
    assert [p.index for p in trimmed.dropped] == [0, 1, 2]
    assert trimmed.num_points == 97 and len(trimmed.residuals) == 100
    assert trimmed.alpha == pytest.approx(TRUTH["alpha"], abs=0.04)
    assert "MAD" in trimmed.dropped[0].reason


def test_heldout_error_predicts_the_largest_compute_points():
    fit = fit_loss_law(*synthetic(100, seed=3), heldout_fraction=0.2, num_bootstrap=0)
    assert fit.num_heldout == 20
    assert fit.heldout_rmse_log == pytest.approx(0.01, abs=0.005)


def test_compute_optimal_is_the_minimum_along_the_isoflop_line(hoffmann_fit):
    c = 1e21
    n_opt, d_opt = compute_optimal_allocation(c, TRUTH["A"], TRUTH["B"], TRUTH["alpha"], TRUTH["beta"])
    assert 6 * n_opt * d_opt == pytest.approx(c)
    ns = n_opt * np.exp(np.linspace(-0.5, 0.5, 1001))
    assert ns[np.argmin(law(ns, c / (6 * ns)))] == pytest.approx(n_opt, rel=1e-3)
    optimal = hoffmann_fit.compute_optimal([c])
    low, high = optimal.n_opt_interval[0]
    assert low <= n_opt <= high
    assert optimal.n_exponent == pytest.approx(0.28 / 0.62, abs=0.03)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda n, d, l: (n[:9], d[:9], l[:9]), "at least 10 points"),
    (lambda n, d, l: (np.where(np.arange(len(n)) % 2, 1e8, 1e9), d, l), "3 distinct model sizes N"),
    (lambda n, d, l: (n, 20 * n, l), "collinear"),
    (lambda n, d, l: (n, d, np.where(np.arange(len(l)) == 4, 0.0, l)), "non-positive"),
    (lambda n, d, l: (n, d, np.where(np.arange(len(l)) == 4, np.nan, l)), "non-finite"),
])
def test_loss_law_refuses_too_few_or_degenerate_points(mutate, message):
    with pytest.raises(ValueError, match=message):
        fit_loss_law(*mutate(*synthetic(30, seed=4)), num_bootstrap=0)


def test_a_law_the_points_do_not_determine_comes_with_a_warning():
    rng = np.random.default_rng(0)
    n, d = 10 ** rng.uniform(7, 10, 60), 10 ** rng.uniform(9, 12, 60)
    loss = (1.69 + 406.4 / n**0.34) * np.exp(rng.normal(0, 0.01, 60))  # loss does not depend on D
    fit = fit_loss_law(n, d, loss, num_bootstrap=20)
    assert any("beta" in w for w in fit.warnings)


def isoflop_points(seed, budgets=np.logspace(18, 21, 7), per_budget=9):
    rng = np.random.default_rng(seed)
    n_true, _ = compute_optimal_allocation(budgets, TRUTH["A"], TRUTH["B"], TRUTH["alpha"], TRUTH["beta"])
    n = n_true[:, None] * np.logspace(-0.8, 0.8, per_budget)[None, :]
    c = np.repeat(budgets[:, None], per_budget, axis=1)
    loss = law(n, c / (6 * n)) * np.exp(rng.normal(0, 0.002, n.shape))
    return n_true, n.ravel(), loss.ravel(), c.ravel()


def test_isoflop_minima_recover_the_true_optimum():
    n_true, n, loss, c = isoflop_points(seed=0)
    fit = fit_isoflop_minima(n, loss, c)
    # A parabola in log N is only an approximation to the law's profile: ≤ 8% bias in N_opt.
    assert [m.n_opt / t for m, t in zip(fit.minima, n_true, strict=True)] == pytest.approx([1.0] * 7, abs=0.08)
    assert fit.n_law.exponent == pytest.approx(0.28 / 0.62, abs=0.01)
    assert fit.d_law.exponent == pytest.approx(0.34 / 0.62, abs=0.01)
    assert fit.n_law.exponent_interval[0] < 0.28 / 0.62 < fit.n_law.exponent_interval[1]
    assert fit.rejected == () and fit.warnings == ()
    # Approach 2 and approach 3 agree on this data: compare with the law's closed form.
    parametric, _ = compute_optimal_allocation(1e22, TRUTH["A"], TRUTH["B"], TRUTH["alpha"], TRUTH["beta"])
    assert fit.n_law.predict(1e22) == pytest.approx(parametric, rel=0.1)


def test_isoflop_refuses_small_and_upside_down_budgets():
    _, n, loss, c = isoflop_points(seed=1, budgets=np.logspace(18, 21, 5))
    n, loss, c = list(n), list(loss), list(c)
    n += [1e8, 2e8]  # a budget with 2 points
    loss += [3.0, 2.9]
    c += [1e23, 1e23]
    n += [1e8, 2e8, 4e8]  # a budget whose losses peak in the middle
    loss += [3.0, 3.2, 3.0]
    c += [1e24] * 3
    fit = fit_isoflop_minima(n, loss, c)
    assert len(fit.minima) == 5
    assert [r.compute for r in fit.rejected] == pytest.approx([1e23, 1e24])
    assert "at least 3" in fit.rejected[0].reason and "downward" in fit.rejected[1].reason
    with pytest.raises(ValueError, match="at least 3 compute budgets"):
        fit_isoflop_minima(n[:18], loss[:18], c[:18])


def hyperparameter_records(seed):
    """Grids of lr × batch per budget around DeepSeek LLM's fitted optima, loss quadratic in their logs."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in np.logspace(17, 20, 7):
        lr_star, batch_star = 0.3118 * c**-0.125, 0.292 * c**0.3271
        for lr in lr_star * 2.0 ** (np.arange(-8, 9) / 4 + rng.uniform(-0.125, 0.125)):
            for batch in batch_star * 2.0 ** (np.arange(-4, 5) / 2 + rng.uniform(-0.25, 0.25)):
                shape = 1 + 0.01 * math.log(lr / lr_star) ** 2 + 0.005 * math.log(batch / batch_star) ** 2
                rows.append((c, lr, batch, 3.0 * c**-0.05 * shape * math.exp(rng.normal(0, 5e-4))))
    return [np.array(col) for col in zip(*rows, strict=True)]


def test_hyperparameter_laws_recover_known_exponents():
    laws = fit_hyperparameter_laws(*hyperparameter_records(seed=0))
    assert laws.lr_law.exponent == pytest.approx(-0.125, abs=0.02)
    assert laws.batch_law.exponent == pytest.approx(0.3271, abs=0.03)
    assert laws.lr_law.exponent_interval[0] < -0.125 < laws.lr_law.exponent_interval[1]
    assert all(b.num_near_best > 1 for b in laws.best)  # the 0.25% band averages several runs
    assert laws.lr_law.loo_rmse_log < 0.1 and laws.lr_law.extrapolation_error_log is not None
    json.dumps(laws.as_dict())


def test_hyperparameter_laws_refuse_fewer_than_three_budgets():
    c, lr, batch, loss = hyperparameter_records(seed=0)
    two = c < 1e18
    with pytest.raises(ValueError, match="3 or more compute budgets"):
        fit_hyperparameter_laws(c[two], lr[two], batch[two], loss[two])


def test_power_law_exact_and_flat():
    fit = fit_power_law([1e18, 1e19, 1e20, 1e21], [0.3 * c**-0.125 for c in (1e18, 1e19, 1e20, 1e21)])
    assert fit.coefficient == pytest.approx(0.3) and fit.exponent == pytest.approx(-0.125)
    assert fit.rmse_log == pytest.approx(0, abs=1e-12) and fit.extrapolation_error_log == pytest.approx(0, abs=1e-9)
    flat = fit_power_law([1, 10, 100, 1000], [1.0, 1.1, 0.9, 1.0])
    assert any("includes 0" in w for w in flat.warnings)
    with pytest.raises(ValueError, match="3 distinct x"):
        fit_power_law([1, 10], [1, 2])


def test_group_budgets_merges_rounding_but_not_neighbours():
    assert group_budgets([1e20, 1.02e20, 3e20, 2.99e20, 1e21]).tolist() == [0, 0, 1, 1, 2]


# Besiroglu et al. 2024's refit of Chinchilla's approach 3 (their Table 1), over the range of
# Hoffmann et al.'s runs. Over 12 seeds at 245 points and σ = 0.01 the estimator's sd was
# α 0.011, β 0.0054, E 0.016 (A and B trade off along a ridge: sd 96 and 208): 3 sd tolerances.
BESIROGLU = {"E": 1.82, "A": 482.0, "B": 2085.0, "alpha": 0.348, "beta": 0.366}


def test_loss_law_recovers_the_chinchilla_replication_from_its_own_law():
    rng = np.random.default_rng(0)
    n = 10 ** rng.uniform(np.log10(5e7), np.log10(1.6e10), 245)
    d = 10 ** rng.uniform(np.log10(2e8), np.log10(4e11), 245)
    truth = BESIROGLU["E"] + BESIROGLU["A"] / n ** BESIROGLU["alpha"] + BESIROGLU["B"] / d ** BESIROGLU["beta"]
    fit = fit_loss_law(n, d, truth * np.exp(rng.normal(0, 0.01, 245)), num_bootstrap=100)
    assert fit.alpha == pytest.approx(BESIROGLU["alpha"], abs=0.035)
    assert fit.beta == pytest.approx(BESIROGLU["beta"], abs=0.017)
    assert fit.E == pytest.approx(BESIROGLU["E"], abs=0.05)
    assert fit.A == pytest.approx(BESIROGLU["A"], rel=0.6) and fit.B == pytest.approx(BESIROGLU["B"], rel=0.3)
    for name, value in BESIROGLU.items():
        low, high = fit.intervals[name]
        assert low <= value <= high, f"{name}={value} outside its 95% interval [{low}, {high}]"


def test_prediction_intervals_cover_new_runs_at_their_level(hoffmann_fit):
    # new runs from the same law, range and noise as the fitted ones: about 95% land inside
    n, d, loss = synthetic(400, seed=9)
    inside = 0
    for ni, di, li in zip(n, d, loss, strict=True):
        low, high = hoffmann_fit.prediction_interval(ni, di)
        inside += low <= li <= high
    assert 0.9 <= inside / 400 <= 0.99
    # a law fitted without its bootstrap cannot say how sure it is
    with pytest.raises(ValueError, match="no bootstrap"):
        fit_loss_law(*synthetic(30, seed=1), num_bootstrap=0).prediction_interval(1e9, 1e10)


def test_prediction_intervals_widen_to_the_held_out_error_of_extrapolating(hoffmann_fit):
    """In-sample residuals understate the error beyond the points: a larger held-out RMSE scales them."""
    n, d = 2e9, 4e10
    low, high = hoffmann_fit.prediction_interval(n, d)
    assert replace(hoffmann_fit, heldout_rmse_log=0.5 * hoffmann_fit.rmse_log).prediction_interval(n, d) == (low, high)
    wide_low, wide_high = replace(hoffmann_fit, heldout_rmse_log=3 * hoffmann_fit.rmse_log).prediction_interval(n, d)
    assert wide_low < low and wide_high > high
    assert 2.0 < np.log(wide_high / wide_low) / np.log(high / low) < 3.0  # the law's own uncertainty is not scaled
