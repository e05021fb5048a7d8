"""Scaling laws fitted to sweep results: the loss law, IsoFLOP minima and hyper-parameter laws.

Three fits, each returning a frozen result with its parameters, intervals, residuals, goodness of
fit and a `warnings` list that says when a number should not be trusted:

- `fit_loss_law`: L(N, D) = E + A/N^α + B/D^β, fitted as in the Chinchilla replication
  (Besiroglu et al. 2024, following Hoffmann et al. 2022, approach 3): a Huber loss on the
  log-space residuals LSE(a − α log N, b − β log D, e) − log L, minimised with L-BFGS-B, with
  a = log A, b = log B, e = log E. Percentile bootstrap intervals; `compute_optimal` turns the law
  into N*(C), D*(C) in closed form.
- `fit_isoflop_minima`: Hoffmann's approach 2. A parabola of loss against log N per compute budget,
  its vertex is N_opt(C); then power laws N*(C) = k·C^a and D*(C) = C / (6 N*).
- `fit_hyperparameter_laws`: LR*(C) and batch*(C) as power laws through the best runs of each
  budget, as in DeepSeek LLM (2024).

Power laws are straight lines in log-log space fitted by least squares, with t-intervals on the
coefficient and exponent, leave-one-out error, and the error of predicting the largest budget from
the others (the extrapolation a scaling law is for).

Plain numpy/scipy: no orchestration, no tracking.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from scipy import optimize, stats

ArrayLike = Sequence[float] | np.ndarray
T = TypeVar("T")

# Hoffmann et al.'s initialisation grid (as used by Besiroglu et al.), parameters (a, b, e, α, β).
# Every grid point is scored in one vectorised pass and only the best `num_starts` are optimised:
# the grid's job is to find the right basin, and the objective says which points are in it.
_GRID_A = _GRID_B = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
_GRID_E = (-1.0, -0.5, 0.0, 0.5, 1.0)
_GRID_EXPONENT = (0.0, 0.5, 1.0, 1.5, 2.0)
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
# L-BFGS-B bounds on (a, b, e, α, β). The exponents' lower bound 0 is the one that matters: an
# exponent there means the points show no improvement with that variable. The others only keep
# the optimiser finite; a fit that reaches them is reported.
_BOUNDS = ((-30.0, 100.0), (-30.0, 100.0), (-20.0, 20.0), (0.0, 4.0), (0.0, 4.0))
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample × this = its standard deviation


# --------------------------------------------------------------------------------------- loss law


@dataclass(frozen=True)
class DroppedPoint:
    index: int  # position in the caller's input
    residual: float  # log(observed) − log(predicted) under the first fit
    reason: str


@dataclass(frozen=True)
class ComputeOptimal:
    """N*(C), D*(C) from a fitted loss law, with percentile intervals from its bootstrap."""

    compute: tuple[float, ...]
    n_opt: tuple[float, ...]
    d_opt: tuple[float, ...]
    n_opt_interval: tuple[tuple[float, float], ...]
    d_opt_interval: tuple[tuple[float, float], ...]
    n_exponent: float  # N* ∝ C^(β/(α+β))
    d_exponent: float  # D* ∝ C^(α/(α+β))
    n_exponent_interval: tuple[float, float]
    d_exponent_interval: tuple[float, float]
    level: float

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self)


@dataclass(frozen=True)
class LossLawFit:
    """A fitted L(N, D) = E + A/N^α + B/D^β; residuals are log(observed) − log(predicted)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    intervals: dict[str, tuple[float, float]]  # percentile bootstrap, per parameter name
    level: float
    num_points: int  # points the final fit used (after any outlier rule)
    num_bootstrap: int
    huber_delta: float
    outlier_mad_k: float | None
    residuals: tuple[float, ...]  # every input point, in input order, dropped ones included
    dropped: tuple[DroppedPoint, ...]
    rmse_log: float  # over the points the fit used
    heldout_fraction: float | None
    heldout_rmse_log: float | None  # largest-compute points predicted by a fit to the rest
    num_heldout: int
    warnings: tuple[str, ...]
    bootstrap_params: np.ndarray = field(repr=False, compare=False)  # (num_bootstrap, 5) in PARAM_NAMES order

    def predict(self, n: ArrayLike, d: ArrayLike) -> np.ndarray:
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def prediction_interval(self, n: float, d: float, *, level: float | None = None,
                            seed: int = 0) -> tuple[float, float]:
        """Where one new run at (n, d) should land: a bootstrap prediction interval.

        Each bootstrap law's prediction is multiplied by exp(a residual drawn from the fit's own
        residuals), so the interval holds both the law's uncertainty and the scatter of single
        runs about it (seeds, data order): a confidence interval of the law alone would fail
        a correct law on run-to-run noise. In-sample residuals understate the error of predicting
        beyond the points, so when the held-out check (the largest-compute points predicted by a
        fit to the rest) erred more, they are scaled up to its RMSE. No floor: it is as wide as the
        evidence says.
        """
        if not len(self.bootstrap_params):
            raise ValueError("this fit has no bootstrap (num_bootstrap=0): it cannot give a prediction interval")
        boot = self.bootstrap_params
        preds = boot[:, 0] + boot[:, 1] / n ** boot[:, 3] + boot[:, 2] / d ** boot[:, 4]
        kept = np.array([r for i, r in enumerate(self.residuals) if i not in {p.index for p in self.dropped}])
        rms = float(np.sqrt(np.mean(kept**2))) if kept.size else 0.0
        scale = max(1.0, self.heldout_rmse_log / rms) if self.heldout_rmse_log and rms > 0 else 1.0
        rng = np.random.default_rng(seed)
        draws = np.log(preds) + scale * rng.choice(kept, size=len(preds))
        lo_q, hi_q = _quantiles(self.level if level is None else level)
        return float(np.exp(np.quantile(draws, lo_q))), float(np.exp(np.quantile(draws, hi_q)))

    def compute_optimal(self, compute: ArrayLike) -> ComputeOptimal:
        """Compute-optimal N and D for budgets C = 6ND, intervals from the bootstrap fits."""
        c = np.atleast_1d(np.asarray(compute, dtype=float))
        if not np.all(np.isfinite(c) & (c > 0)):
            raise ValueError("compute_optimal needs finite, positive compute budgets (FLOPs)")
        n_opt, d_opt = compute_optimal_allocation(c, self.A, self.B, self.alpha, self.beta)
        boot = self.bootstrap_params
        lo_q, hi_q = _quantiles(self.level)
        if len(boot):
            bn, bd = compute_optimal_allocation(c[None, :], boot[:, 1:2], boot[:, 2:3], boot[:, 3:4], boot[:, 4:5])
            n_iv = tuple(zip(np.quantile(bn, lo_q, axis=0), np.quantile(bn, hi_q, axis=0), strict=True))
            d_iv = tuple(zip(np.quantile(bd, lo_q, axis=0), np.quantile(bd, hi_q, axis=0), strict=True))
            exp_n = boot[:, 4] / (boot[:, 3] + boot[:, 4])
            n_exp_iv = (float(np.quantile(exp_n, lo_q)), float(np.quantile(exp_n, hi_q)))
        else:
            n_iv = d_iv = tuple((math.nan, math.nan) for _ in c)
            n_exp_iv = (math.nan, math.nan)
        a = self.beta / (self.alpha + self.beta)
        return ComputeOptimal(
            compute=tuple(c.tolist()), n_opt=tuple(n_opt.tolist()), d_opt=tuple(d_opt.tolist()),
            n_opt_interval=_pairs(n_iv), d_opt_interval=_pairs(d_iv), n_exponent=a, d_exponent=1.0 - a,
            n_exponent_interval=n_exp_iv, d_exponent_interval=(1.0 - n_exp_iv[1], 1.0 - n_exp_iv[0]),
            level=self.level)

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self, skip=("bootstrap_params",))


def compute_optimal_allocation(compute: ArrayLike, A: Any, B: Any, alpha: Any,
                               beta: Any) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form minimiser of the loss law at fixed C = 6ND (Hoffmann et al., eq. 4).

    N* = G (C/6)^(β/(α+β)), D* = G⁻¹ (C/6)^(α/(α+β)), G = (αA / (βB))^(1/(α+β)). Broadcasts.
    """
    c6 = np.asarray(compute, dtype=float) / 6.0
    alpha, beta = np.asarray(alpha, dtype=float), np.asarray(beta, dtype=float)
    g = (alpha * np.asarray(A, dtype=float) / (beta * np.asarray(B, dtype=float))) ** (1.0 / (alpha + beta))
    return g * c6 ** (beta / (alpha + beta)), c6 ** (alpha / (alpha + beta)) / g


def _one_blas_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Run `fn` with BLAS on one thread.

    L-BFGS-B calls BLAS on 5-vectors thousands of times; a multi-threaded OpenBLAS wakes its
    thread pool for each, which made a 25-point fit with 100 bootstraps take 41 s instead of 5 s
    on a busy 2-core machine (threadpoolctl ships with scikit-learn).
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper


@_one_blas_thread
def fit_loss_law(
    n: ArrayLike,
    d: ArrayLike,
    loss: ArrayLike,
    *,
    huber_delta: float = 1e-3,
    outlier_mad_k: float | None = None,
    num_bootstrap: int = 200,
    level: float = 0.95,
    num_starts: int = 16,
    heldout_fraction: float | None = None,
    min_points: int = 10,
    seed: int = 0,
) -> LossLawFit:
    """Fit L(N, D) = E + A/N^α + B/D^β to (parameters, tokens, loss) points.

    Outlier policy: the Huber loss with `huber_delta` on log residuals already treats any point
    further than δ from the law linearly (δ = 1e-3, Hoffmann's choice, makes the fit close to a
    least-absolute-deviation fit, so a few wild points cannot drag the exponents). With
    `outlier_mad_k`, points whose first-fit residual is more than k robust standard deviations
    (k × 1.4826 × MAD) from the median residual are also dropped and the law refitted; dropped
    points are listed in `dropped` with their residuals, never discarded silently.

    Intervals are percentile bootstrap intervals at `level` over `num_bootstrap` resamples of the
    points; each resample is refitted from the full-data optimum, not from the grid (the
    resample's optimum lies in the same basin, and one L-BFGS-B run replaces `num_starts`).

    `heldout_fraction`: also fit the law to all but that fraction of points with the largest
    compute 6ND and report the RMSE of the log residuals on them (`heldout_rmse_log`).

    Raises ValueError on fewer than `min_points` points, fewer than 3 distinct N or D, N and D that
    move together (the exponents cannot be told apart), or non-finite / non-positive values.
    """
    n_arr, d_arr, l_arr = _check_loss_law_input(n, d, loss, min_points)
    if not huber_delta > 0:
        raise ValueError(f"huber_delta must be positive (got {huber_delta})")
    if outlier_mad_k is not None and not outlier_mad_k > 0:
        raise ValueError(f"outlier_mad_k must be positive or None (got {outlier_mad_k})")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95 (got {level})")
    if num_bootstrap < 0:
        raise ValueError(f"num_bootstrap must be >= 0 (got {num_bootstrap})")
    if heldout_fraction is not None and not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), e.g. 0.2, or None (got {heldout_fraction})")
    x_all, y_all, t_all = np.log(n_arr), np.log(d_arr), np.log(l_arr)
    warnings: list[str] = []

    theta, converged = _fit_from_grid(x_all, y_all, t_all, huber_delta, num_starts)
    keep = np.ones(len(x_all), dtype=bool)
    dropped: list[DroppedPoint] = []
    if outlier_mad_k is not None:
        resid = t_all - _log_law(theta, x_all, y_all)
        centre = np.median(resid)
        scale = MAD_TO_SIGMA * np.median(np.abs(resid - centre))
        if scale > 0:
            keep = np.abs(resid - centre) <= outlier_mad_k * scale
            reason = f"|residual − median| > {outlier_mad_k:g} × 1.4826 × MAD = {outlier_mad_k * scale:.4g}"
            dropped = [DroppedPoint(int(i), float(resid[i]), reason) for i in np.flatnonzero(~keep)]
            if dropped:
                _check_loss_law_input(n_arr[keep], d_arr[keep], l_arr[keep], min_points,
                                      after=f"dropping {len(dropped)} outliers (outlier_mad_k={outlier_mad_k:g})")
                theta, converged = _refit(theta, x_all[keep], y_all[keep], t_all[keep], huber_delta)
    if not converged:
        warnings.append("L-BFGS-B did not report convergence on the full data; the parameters may be off")

    x, y, t = x_all[keep], y_all[keep], t_all[keep]
    residuals = t_all - _log_law(theta, x_all, y_all)
    rmse = float(np.sqrt(np.mean(residuals[keep] ** 2)))

    rng = np.random.default_rng(seed)
    boot = np.empty((num_bootstrap, 5))
    num_failed = 0
    for i in range(num_bootstrap):
        idx = rng.integers(0, len(x), len(x))
        theta_i, ok = _refit(theta, x[idx], y[idx], t[idx], huber_delta)
        num_failed += not ok
        boot[i] = _natural(theta_i)
    lo_q, hi_q = _quantiles(level)
    intervals = {name: (float(np.quantile(boot[:, j], lo_q)), float(np.quantile(boot[:, j], hi_q)))
                 if num_bootstrap else (math.nan, math.nan) for j, name in enumerate(PARAM_NAMES)}
    if num_bootstrap and num_failed > 0.1 * num_bootstrap:
        warnings.append(f"{num_failed} of {num_bootstrap} bootstrap refits did not converge; intervals are rough")

    natural = dict(zip(PARAM_NAMES, _natural(theta).tolist(), strict=True))
    warnings += _bound_warnings(theta)
    for name in ("alpha", "beta"):
        low, high = intervals[name]
        if num_bootstrap and low <= 1e-3:
            warnings.append(f"the {level:.0%} interval of {name} [{low:.3g}, {high:.3g}] includes 0: the points do "
                            f"not show loss falling with {'N' if name == 'alpha' else 'D'}; do not extrapolate with it")
    if num_bootstrap == 0:
        warnings.append("num_bootstrap=0: no intervals; the parameters' uncertainty is unknown")
    if natural["E"] < 1e-3 * float(np.exp(t.min())):
        warnings.append(f"E = {natural['E']:.3g} is not determined: every loss lies far above the irreducible "
                        "term, so the fit drove it to ~0; the power terms carry the law, and predictions far "
                        "beyond the points' range overstate how low the loss goes")

    heldout_rmse, num_heldout = None, 0
    if heldout_fraction is not None:
        try:
            heldout_rmse, num_heldout = _heldout_error(x, y, t, heldout_fraction, huber_delta, num_starts, min_points)
        except ValueError as error:  # too few points to spare some: the fit stands, unjudged on extrapolation
            warnings.append(f"no held-out check: {error}")
        if heldout_rmse is not None and heldout_rmse > 3 * max(rmse, 1e-4):
            warnings.append(f"held-out RMSE of log loss {heldout_rmse:.3g} is over 3× the in-sample {rmse:.3g}: "
                            "the law extrapolates poorly to larger compute")

    return LossLawFit(
        **natural, intervals=intervals, level=level, num_points=int(keep.sum()), num_bootstrap=num_bootstrap,
        huber_delta=huber_delta, outlier_mad_k=outlier_mad_k, residuals=tuple(residuals.tolist()),
        dropped=tuple(dropped), rmse_log=rmse, heldout_fraction=heldout_fraction, heldout_rmse_log=heldout_rmse,
        num_heldout=num_heldout, warnings=tuple(warnings), bootstrap_params=boot)


def _check_loss_law_input(n: ArrayLike, d: ArrayLike, loss: ArrayLike, min_points: int,
                          after: str = "") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = []
    for name, values in (("n (parameters)", n), ("d (tokens)", d), ("loss", loss)):
        arr = np.asarray(values, dtype=float)
        if arr.ndim != 1:
            raise ValueError(f"fit_loss_law: {name} must be a 1-D sequence (got shape {arr.shape})")
        bad = ~(np.isfinite(arr) & (arr > 0))
        if bad.any():
            raise ValueError(f"fit_loss_law: {name} has {int(bad.sum())} non-finite or non-positive values "
                             f"(first at index {int(np.flatnonzero(bad)[0])}); every value must be finite and > 0")
        arrays.append(arr)
    n_arr, d_arr, l_arr = arrays
    if not len(n_arr) == len(d_arr) == len(l_arr):
        raise ValueError(f"fit_loss_law: n, d and loss differ in length ({len(n_arr)}, {len(d_arr)}, {len(l_arr)})")
    suffix = f" after {after}" if after else ""
    if len(n_arr) < min_points:
        raise ValueError(f"fit_loss_law needs at least {min_points} points to fit 5 parameters and judge the fit; "
                         f"got {len(n_arr)}{suffix}: train more (N, D) runs")
    for name, arr in (("model sizes N", n_arr), ("token counts D", d_arr)):
        distinct = np.unique(arr).size
        if distinct < 3:
            raise ValueError(f"fit_loss_law needs at least 3 distinct {name}; got {distinct}{suffix}: "
                             f"vary {name.split()[-1]} over at least 3 values")
    r = np.corrcoef(np.log(n_arr), np.log(d_arr))[0, 1]
    if abs(r) > 0.999:
        raise ValueError(f"fit_loss_law: log N and log D are collinear (correlation {r:.4f}){suffix}, so α and β "
                         f"cannot be told apart: add runs with several token counts at the same model size")
    return n_arr, d_arr, l_arr


def _log_law(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a, b, e, alpha, beta = theta
    return np.logaddexp(np.logaddexp(a - alpha * x, b - beta * y), e)


def _natural(theta: np.ndarray) -> np.ndarray:
    a, b, e, alpha, beta = theta
    return np.array([math.exp(e), math.exp(a), math.exp(b), alpha, beta])


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray,
               delta: float) -> tuple[float, np.ndarray]:
    """Σ Huber_δ(r)/δ with its gradient, r = LSE(a − αx, b − βy, e) − t.

    Divided by δ so the objective is of order (number of points × typical |r|), not 1e-5:
    L-BFGS-B's relative stopping rule would otherwise stop at the first step.
    """
    a, b, e, alpha, beta = theta
    t1 = a - alpha * x
    t2 = b - beta * y
    m = np.maximum(np.maximum(t1, t2), e)
    w1, w2, w3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = w1 + w2 + w3
    r = m + np.log(s) - t
    absr = np.abs(r)
    quad = absr <= delta
    value = np.where(quad, 0.5 * r * r / delta, absr - 0.5 * delta)
    dr = np.where(quad, r / delta, np.sign(r)) / s
    g1, g2 = dr @ w1, dr @ w2
    grad = np.array([g1, g2, dr @ w3, -(dr * w1) @ x, -(dr * w2) @ y])
    return float(value.sum()), grad


def _grid() -> np.ndarray:
    return np.array(list(itertools.product(_GRID_A, _GRID_B, _GRID_E, _GRID_EXPONENT, _GRID_EXPONENT)))


def _grid_scores(grid: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray, delta: float) -> np.ndarray:
    scores = np.empty(len(grid))
    chunk = max(1, 2_000_000 // len(x))  # bound the temporary arrays to ~16 MB each
    for start in range(0, len(grid), chunk):
        g = grid[start:start + chunk]
        t1 = g[:, 0:1] - g[:, 3:4] * x
        t2 = g[:, 1:2] - g[:, 4:5] * y
        r = np.logaddexp(np.logaddexp(t1, t2), g[:, 2:3]) - t
        absr = np.abs(r)
        scores[start:start + chunk] = np.where(absr <= delta, 0.5 * r * r / delta, absr - 0.5 * delta).sum(axis=1)
    return scores


def _refit(theta0: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray, delta: float) -> tuple[np.ndarray, bool]:
    res = optimize.minimize(_objective, theta0, args=(x, y, t, delta), jac=True, method="L-BFGS-B",
                            bounds=_BOUNDS, options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9})
    # ABNORMAL (status 2) at a flat optimum of a Huber loss is common and harmless once the
    # objective stopped improving; count only the iteration limit as a failure.
    return res.x, res.status != 1


def _fit_from_grid(x: np.ndarray, y: np.ndarray, t: np.ndarray, delta: float,
                   num_starts: int) -> tuple[np.ndarray, bool]:
    grid = _grid()
    scores = _grid_scores(grid, x, y, t, delta)
    starts = grid[np.argsort(scores, kind="stable")[:max(1, num_starts)]]
    best, best_value, best_ok = None, math.inf, False
    for start in starts:
        theta, ok = _refit(start, x, y, t, delta)
        value = _objective(theta, x, y, t, delta)[0]
        if value < best_value:
            best, best_value, best_ok = theta, value, ok
    assert best is not None
    return best, best_ok


def _bound_warnings(theta: np.ndarray) -> list[str]:
    names = ("a = log A", "b = log B", "e = log E", "alpha", "beta")
    out = []
    for value, (low, high), name in zip(theta, _BOUNDS, names, strict=True):
        for bound in (low, high):
            if abs(value - bound) <= 1e-6 * max(1.0, abs(bound)):
                out.append(f"the fit hit the bound {name} = {bound:g}: that parameter is not determined by these "
                           "points (too narrow a range of N or D, or loss not falling with it)")
    return out


def _heldout_error(x: np.ndarray, y: np.ndarray, t: np.ndarray, fraction: float, delta: float, num_starts: int,
                   min_points: int) -> tuple[float, int]:
    num_heldout = max(1, math.ceil(fraction * len(x)))
    order = np.argsort(x + y, kind="stable")  # log(N·D): compute up to the constant 6
    train, test = order[:-num_heldout], order[-num_heldout:]
    _check_loss_law_input(np.exp(x[train]), np.exp(y[train]), np.exp(t[train]), min_points,
                          after=f"holding out the {num_heldout} largest-compute points")
    theta, _ = _fit_from_grid(x[train], y[train], t[train], delta, num_starts)
    resid = t[test] - _log_law(theta, x[test], y[test])
    return float(np.sqrt(np.mean(resid**2))), num_heldout


# ------------------------------------------------------------------------------------ power laws


@dataclass(frozen=True)
class PowerLawFit:
    """y = coefficient · x^exponent, least squares in log-log space; residuals in log y."""

    coefficient: float
    exponent: float
    coefficient_interval: tuple[float, float]  # t-interval at `level`
    exponent_interval: tuple[float, float]
    level: float
    x: tuple[float, ...]
    y: tuple[float, ...]
    residuals: tuple[float, ...]  # log y − log ŷ
    rmse_log: float
    loo_rmse_log: float  # leave-one-out prediction error in log y
    extrapolation_error_log: float | None  # log y − log ŷ at the largest x, fitted without it (needs 4 points)
    warnings: tuple[str, ...]

    def predict(self, x: ArrayLike) -> np.ndarray:
        return self.coefficient * np.asarray(x, dtype=float) ** self.exponent

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self)


def fit_power_law(x: ArrayLike, y: ArrayLike, *, level: float = 0.95, what: str = "y(x)") -> PowerLawFit:
    """Fit y = k · x^a by ordinary least squares on (log x, log y); needs 3 distinct x."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if not (np.all(np.isfinite(lx)) and np.all(np.isfinite(ly))):
        raise ValueError(f"power law {what}: every x and y must be finite and > 0")
    if np.unique(lx).size < 3:
        raise ValueError(f"power law {what} needs at least 3 distinct x values to fit and judge a line "
                         f"(got {np.unique(lx).size}): add more compute budgets")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95 (got {level})")
    slope, intercept, se_slope, se_intercept, resid = _ols(lx, ly)
    dof = len(lx) - 2
    tq = float(stats.t.ppf(0.5 + level / 2, dof)) if dof > 0 else math.inf
    loo = []
    for i in range(len(lx)):
        mask = np.arange(len(lx)) != i
        if np.unique(lx[mask]).size >= 2:
            s, c = np.polyfit(lx[mask], ly[mask], 1)
            loo.append(ly[i] - (s * lx[i] + c))
    extrapolation = None
    largest = int(np.argmax(lx))
    rest = np.arange(len(lx)) != largest
    if np.unique(lx[rest]).size >= 3:
        s, c = np.polyfit(lx[rest], ly[rest], 1)
        extrapolation = float(ly[largest] - (s * lx[largest] + c))
    warnings = []
    if dof == 1:
        warnings.append(f"power law {what}: 3 points leave 1 degree of freedom; the intervals are very wide")
    exp_iv = (slope - tq * se_slope, slope + tq * se_slope)
    if exp_iv[0] <= 0 <= exp_iv[1]:
        warnings.append(f"power law {what}: the {level:.0%} interval of the exponent [{exp_iv[0]:.3g}, "
                        f"{exp_iv[1]:.3g}] includes 0; the points show no trend with x")
    return PowerLawFit(
        coefficient=float(math.exp(intercept)), exponent=float(slope),
        coefficient_interval=(float(math.exp(intercept - tq * se_intercept)),
                              float(math.exp(intercept + tq * se_intercept))),
        exponent_interval=(float(exp_iv[0]), float(exp_iv[1])), level=level,
        x=tuple(np.exp(lx).tolist()), y=tuple(np.exp(ly).tolist()), residuals=tuple(resid.tolist()),
        rmse_log=float(np.sqrt(np.mean(resid**2))),
        loo_rmse_log=float(np.sqrt(np.mean(np.square(loo)))) if loo else math.nan,
        extrapolation_error_log=extrapolation, warnings=tuple(warnings))


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float, np.ndarray]:
    """Slope, intercept, their standard errors and the residuals of y = slope·x + intercept."""
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * xm)
    resid = y - (slope * x + intercept)
    dof = len(x) - 2
    s2 = float(resid @ resid) / dof if dof > 0 else math.inf
    return slope, intercept, math.sqrt(s2 / sxx), math.sqrt(s2 * (1 / len(x) + xm**2 / sxx)), resid


def group_budgets(compute: ArrayLike, rtol: float = 0.05) -> np.ndarray:
    """Label points by compute budget: values within a factor (1 + rtol) of their neighbour share a label.

    Labels are 0, 1, ... in increasing compute. Budgets are usually set exactly (C = 6ND with N, D
    rounded), so a few percent absorbs the rounding without merging neighbouring budgets.
    """
    lc = np.log(np.asarray(compute, dtype=float))
    if not np.all(np.isfinite(lc)):
        raise ValueError("compute budgets must be finite and > 0")
    order = np.argsort(lc, kind="stable")
    labels = np.empty(len(lc), dtype=int)
    label, previous = 0, None
    for i in order:
        if previous is not None and lc[i] - previous > math.log1p(rtol):
            label += 1
        labels[i] = label
        previous = lc[i]
    return labels


# ------------------------------------------------------------------------------- IsoFLOP minima


@dataclass(frozen=True)
class IsoFlopMinimum:
    compute: float
    n_opt: float
    d_opt: float  # compute / (6 n_opt)
    loss_at_opt: float
    num_points: int
    rmse: float  # of the parabola, in loss units
    n_range: tuple[float, float]  # the sampled model sizes


@dataclass(frozen=True)
class RejectedBudget:
    compute: float
    num_points: int
    reason: str


@dataclass(frozen=True)
class IsoFlopFit:
    minima: tuple[IsoFlopMinimum, ...]
    rejected: tuple[RejectedBudget, ...]
    n_law: PowerLawFit  # N*(C) = k · C^a
    d_law: PowerLawFit  # D*(C) = C / (6 N*)
    warnings: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self)


def fit_isoflop_minima(
    n: ArrayLike,
    loss: ArrayLike,
    compute: ArrayLike | None = None,
    *,
    d: ArrayLike | None = None,
    group_rtol: float = 0.05,
    level: float = 0.95,
) -> IsoFlopFit:
    """Chinchilla approach 2: per-budget parabola minima, then N*(C) and D*(C) power laws.

    Points are grouped by `compute` (each point's budget; give the nominal budget if you have it)
    or, without it, by 6·n·d, merging values within `group_rtol`. Each budget's loss is fitted with
    a parabola in log N; its vertex is N_opt. A budget is refused (listed in `rejected`, with the
    reason) with fewer than 3 points, or 3 distinct N, or a parabola that opens downward. A vertex
    outside the sampled N range is kept but warned about: it is an extrapolation.
    Raises ValueError when fewer than 3 budgets remain.
    """
    n_arr, l_arr = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    if compute is None:
        if d is None:
            raise ValueError("fit_isoflop_minima needs each point's compute budget: pass compute, or d (tokens) "
                             "to use C = 6·N·D")
        compute = 6.0 * n_arr * np.asarray(d, dtype=float)
    c_arr = np.asarray(compute, dtype=float)
    if not n_arr.shape == l_arr.shape == c_arr.shape or n_arr.ndim != 1:
        raise ValueError(f"fit_isoflop_minima: n, loss and compute must be 1-D of one length "
                         f"(got {n_arr.shape}, {l_arr.shape}, {c_arr.shape})")
    for name, arr in (("n", n_arr), ("loss", l_arr), ("compute", c_arr)):
        if not np.all(np.isfinite(arr) & (arr > 0)):
            raise ValueError(f"fit_isoflop_minima: every {name} must be finite and > 0")
    labels = group_budgets(c_arr, group_rtol)
    minima, rejected, warnings = [], [], []
    for label in np.unique(labels):
        members = labels == label
        budget = float(np.exp(np.mean(np.log(c_arr[members]))))
        ln, ll = np.log(n_arr[members]), l_arr[members]
        count = int(members.sum())
        if count < 3 or np.unique(ln).size < 3:
            rejected.append(RejectedBudget(budget, count, f"needs at least 3 distinct model sizes, got "
                                                          f"{np.unique(ln).size}"))
            continue
        centre = ln.mean()  # centring keeps the quadratic fit well conditioned
        p2, p1, p0 = np.polyfit(ln - centre, ll, 2)
        if p2 <= 0:
            rejected.append(RejectedBudget(budget, count, f"the parabola opens downward (curvature {p2:.3g}): "
                                                          "no minimum; sample model sizes on both sides of it"))
            continue
        vertex = -p1 / (2 * p2)
        log_n_opt = centre + vertex
        fitted = np.polyval([p2, p1, p0], ln - centre)
        n_opt = float(np.exp(log_n_opt))
        if not ln.min() <= log_n_opt <= ln.max():
            warnings.append(f"budget {budget:.3g}: the minimum N={n_opt:.3g} lies outside the sampled model sizes "
                            f"[{np.exp(ln.min()):.3g}, {np.exp(ln.max()):.3g}]; it is extrapolated")
        minima.append(IsoFlopMinimum(
            compute=budget, n_opt=n_opt, d_opt=budget / (6.0 * n_opt),
            loss_at_opt=float(p0 - p1 * p1 / (4 * p2)), num_points=count,
            rmse=float(np.sqrt(np.mean((ll - fitted) ** 2))),
            n_range=(float(np.exp(ln.min())), float(np.exp(ln.max())))))
    if len(minima) < 3:
        reasons = "; ".join(f"C={r.compute:.3g}: {r.reason}" for r in rejected) or "none rejected"
        raise ValueError(f"fit_isoflop_minima needs at least 3 compute budgets with a usable minimum to fit "
                         f"N*(C); got {len(minima)} ({reasons}): run more budgets, each with ≥ 3 model sizes "
                         "around the optimum")
    cs = [m.compute for m in minima]
    n_law = fit_power_law(cs, [m.n_opt for m in minima], level=level, what="N*(C)")
    d_law = fit_power_law(cs, [m.d_opt for m in minima], level=level, what="D*(C)")
    return IsoFlopFit(tuple(minima), tuple(rejected), n_law, d_law,
                      tuple(warnings) + n_law.warnings + d_law.warnings)


# ------------------------------------------------------------------------- hyper-parameter laws


@dataclass(frozen=True)
class BudgetBest:
    compute: float
    lr: float  # geometric mean over the near-best runs
    batch: float
    best_loss: float
    num_runs: int
    num_near_best: int


@dataclass(frozen=True)
class HyperparameterLaws:
    best: tuple[BudgetBest, ...]
    lr_law: PowerLawFit  # LR*(C)
    batch_law: PowerLawFit  # batch*(C)
    near_best_rtol: float
    warnings: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(self)


def fit_hyperparameter_laws(
    compute: ArrayLike,
    lr: ArrayLike,
    batch: ArrayLike,
    loss: ArrayLike,
    *,
    near_best_rtol: float = 0.0025,
    group_rtol: float = 0.05,
    level: float = 0.95,
) -> HyperparameterLaws:
    """LR*(C) = k·C^a and batch*(C) = k·C^b through the best runs of each compute budget.

    Selection: per budget, every run within `near_best_rtol` of the budget's lowest loss (DeepSeek
    LLM's 0.25% band) counts as near-optimal, and the budget's optimum is the geometric mean of
    their learning rates and batch sizes. Averaging in log space smooths the grid's quantisation;
    `near_best_rtol=0` takes the single best run. Needs at least 3 budgets.
    """
    arrays = [np.asarray(v, dtype=float) for v in (compute, lr, batch, loss)]
    c_arr, lr_arr, b_arr, l_arr = arrays
    if len({a.shape for a in arrays}) != 1 or c_arr.ndim != 1:
        raise ValueError("fit_hyperparameter_laws: compute, lr, batch and loss must be 1-D of one length")
    for name, arr in zip(("compute", "lr", "batch", "loss"), arrays, strict=True):
        if not np.all(np.isfinite(arr) & (arr > 0)):
            raise ValueError(f"fit_hyperparameter_laws: every {name} must be finite and > 0")
    if near_best_rtol < 0:
        raise ValueError(f"near_best_rtol must be >= 0 (got {near_best_rtol})")
    labels = group_budgets(c_arr, group_rtol)
    best, warnings = [], []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        low = l_arr[members].min()
        near = members[l_arr[members] <= low * (1 + near_best_rtol)]
        budget = float(np.exp(np.mean(np.log(c_arr[members]))))
        lr_best = float(np.exp(np.mean(np.log(lr_arr[near]))))
        batch_best = float(np.exp(np.mean(np.log(b_arr[near]))))
        for name, value, values in (("lr", lr_best, lr_arr[members]), ("batch", batch_best, b_arr[members])):
            if np.unique(values).size > 1 and value in (values.min(), values.max()):
                warnings.append(f"budget {budget:.3g}: the best {name} {value:.3g} is at the edge of the values "
                                "tried; the true optimum may lie beyond it, widen the sweep")
        best.append(BudgetBest(budget, lr_best, batch_best, float(low), len(members), len(near)))
    if len(best) < 3:
        raise ValueError(f"fit_hyperparameter_laws needs runs at 3 or more compute budgets to fit a power law "
                         f"(got {len(best)}): sweep lr and batch at more budgets")
    cs = [b.compute for b in best]
    lr_law = fit_power_law(cs, [b.lr for b in best], level=level, what="LR*(C)")
    batch_law = fit_power_law(cs, [b.batch for b in best], level=level, what="batch*(C)")
    return HyperparameterLaws(tuple(best), lr_law, batch_law, near_best_rtol,
                              tuple(warnings) + lr_law.warnings + batch_law.warnings)


# ------------------------------------------------------------------------------------- helpers


def _quantiles(level: float) -> tuple[float, float]:
    return (1 - level) / 2, (1 + level) / 2


def _pairs(rows: Any) -> tuple[tuple[float, float], ...]:
    return tuple((float(lo), float(hi)) for lo, hi in rows)


def _jsonable(obj: Any, skip: tuple[str, ...] = ()) -> Any:
    """Dataclasses, tuples and numpy scalars as plain JSON-ready dicts, lists and floats."""
    if hasattr(obj, "__dataclass_fields__"):
        return {name: _jsonable(getattr(obj, name)) for name in obj.__dataclass_fields__ if name not in skip}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
