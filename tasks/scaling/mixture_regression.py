"""Mixture regression: predict a target loss from domain weights, then search the simplex for the best mix.

RegMix (Liu et al. 2024) and Data Mixing Laws (Ye et al. 2024) in miniature: many small proxy
runs, each trained on a mixture w (domain weights on the simplex) and scored by a target loss
(one domain's validation loss, or the average over domains). A regression from w to that loss is
fitted and judged by its held-out Spearman rank correlation (k-fold out-of-fold predictions): the
search below only needs the regression to *rank* mixtures correctly.

Two models:
- "ridge": ridge regression on [w, log(w + ε)] (standardised, penalty chosen by leave-one-out on
  the training folds). The log features give it an interior optimum, which a model linear in w
  alone (optimum always at a vertex) cannot have; ε keeps log finite at zero weight.
- "gbm": scikit-learn's GradientBoostingRegressor on w: gradient-boosted trees, RegMix's choice of
  model class (it uses LightGBM; at a few hundred trials exact splits beat histograms).

`recommend_mixture` samples candidates from a Dirichlet around a prior, predicts each, and averages
the top-k candidates' weights: averaging is RegMix's guard against one candidate the regression
happens to over-rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import stats
from scipy.spatial import cKDTree
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import RidgeCV
from sklearn.model_selection import KFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

Model = Literal["ridge", "gbm"]
LOG_EPS = 1e-3  # ε in log(w + ε): a domain at weight 0 is "very little", not −∞
SIMPLEX_ATOL = 1e-4
POOR_SPEARMAN = 0.5  # below this held-out rank correlation the search is not to be trusted


def minimum_trials(num_domains: int, num_folds: int) -> int:
    """Trials needed: 4 per fold so every fold scores a ranking, and 5 per domain for the regression."""
    return max(20, 4 * num_folds, 5 * num_domains)


@dataclass(frozen=True)
class MixtureRegressionFit:
    domains: tuple[str, ...]
    model: Model
    target: str
    num_trials: int
    num_folds: int
    heldout_spearman: float  # out-of-fold predictions against the observed target, pooled
    heldout_rmse: float
    train_rmse: float
    targets: tuple[float, ...]  # the observed target loss, per trial
    heldout_predictions: tuple[float, ...]  # out-of-fold predictions, per trial
    trial_weights: np.ndarray = field(repr=False, compare=False)  # (num_trials, num_domains)
    estimator: Any = field(repr=False, compare=False)  # fitted on every trial
    warnings: tuple[str, ...] = ()

    def predict(self, weights: np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
        w = np.atleast_2d(np.asarray(weights, dtype=float))
        if w.shape[1] != len(self.domains):
            raise ValueError(f"predict needs {len(self.domains)} weights per mixture ({', '.join(self.domains)}); "
                             f"got {w.shape[1]}")
        return self.estimator.predict(w)

    def as_dict(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v, tuple) else v for name, v in self.__dict__.items()
                if name not in ("trial_weights", "estimator")}


@dataclass(frozen=True)
class MixtureRecommendation:
    weights: dict[str, float]
    predicted_loss: float  # the regression's prediction at the recommended weights
    top_k_spread: dict[str, float]  # std of each domain's weight over the top-k candidates
    best_observed_loss: float  # the best trial actually run, for comparison
    nearest_trial_distance: float  # L1 distance from the recommendation to the closest trial
    num_samples: int
    top_k: int
    warnings: tuple[str, ...]
    extrapolates: bool = False  # further from every trial than trials lie from each other

    def as_dict(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v, tuple) else v for name, v in self.__dict__.items()}


def fit_mixture_regression(
    weights: np.ndarray | Sequence[Mapping[str, float]] | Sequence[Sequence[float]],
    losses: Mapping[str, Sequence[float]] | Sequence[float] | np.ndarray,
    *,
    domains: Sequence[str] | None = None,
    target: str = "average",
    model: Model = "gbm",
    num_folds: int = 5,
    seed: int = 0,
) -> MixtureRegressionFit:
    """Fit weights → target loss and score it by k-fold held-out Spearman correlation.

    `weights`: one row per trial, either mappings domain → weight or rows in `domains` order; rows
    must lie on the simplex. `losses`: the target per trial, or mapping eval name → per-trial
    losses, with `target` naming one of them or "average" (their mean). Raises ValueError with the
    number of trials needed (see `minimum_trials`) when there are too few.
    """
    if model not in ("ridge", "gbm"):
        raise AssertionError(model)
    w, names = _weights_matrix(weights, domains)
    y, target_name = _target(losses, target, len(w))
    if num_folds < 2:
        raise ValueError(f"num_folds must be at least 2 (got {num_folds})")
    needed = minimum_trials(len(names), num_folds)
    if len(w) < needed:
        raise ValueError(f"fit_mixture_regression needs at least {needed} trials for {len(names)} domains and "
                         f"{num_folds} folds (max(20, 4 × folds, 5 × domains)); got {len(w)}: run "
                         f"{needed - len(w)} more proxy trials")
    if np.ptp(y) == 0:
        raise ValueError("fit_mixture_regression: the target loss is identical for every trial, so there is no "
                         "ranking to learn; check the losses passed in")
    estimator = _estimator(model, len(w), seed)
    folds = KFold(num_folds, shuffle=True, random_state=seed)
    heldout = cross_val_predict(estimator, w, y, cv=folds)
    estimator.fit(w, y)
    rho = float(stats.spearmanr(heldout, y).statistic)
    resid = y - heldout
    warnings = []
    if not rho >= POOR_SPEARMAN:
        warnings.append(f"held-out Spearman {rho:.2f} is below {POOR_SPEARMAN}: the {model} regression does not "
                        "rank unseen mixtures reliably; do not trust its recommended mixture (more trials, or the "
                        "other model)")
    return MixtureRegressionFit(
        domains=names, model=model, target=target_name, num_trials=len(w), num_folds=num_folds,
        heldout_spearman=rho, heldout_rmse=float(np.sqrt(np.mean(resid**2))),
        train_rmse=float(np.sqrt(np.mean((y - estimator.predict(w)) ** 2))),
        targets=tuple(y.tolist()), heldout_predictions=tuple(heldout.tolist()), trial_weights=w,
        estimator=estimator, warnings=tuple(warnings))


def recommend_mixture(
    fit: MixtureRegressionFit,
    *,
    prior: Mapping[str, float] | Sequence[float] | None = None,
    concentration: float | None = None,
    num_samples: int = 50_000,
    top_k: int = 100,
    seed: int = 0,
) -> MixtureRecommendation:
    """Sample mixtures from Dirichlet(concentration · prior), predict, average the top-k (lowest loss).

    `prior` defaults to the mean of the trial mixtures, so candidates stay where the regression was
    trained; `concentration` defaults to the number of domains (a uniform prior then gives the
    uniform Dirichlet). The recommendation is flagged when it lies further from every trial than
    trials lie from each other: there the regression extrapolates.
    """
    names, k = fit.domains, len(fit.domains)
    if prior is None:
        p = fit.trial_weights.mean(axis=0)
    elif isinstance(prior, Mapping):
        unknown = set(prior) - set(names)
        if unknown:
            raise ValueError(f"prior names unknown domains {sorted(unknown)}; the fit's domains are {list(names)}")
        p = np.array([float(prior.get(name, 0.0)) for name in names])
    else:
        p = np.asarray(prior, dtype=float)
    if p.shape != (k,) or not np.all(np.isfinite(p) & (p > 0)):
        raise ValueError(f"prior needs a positive weight for each of the {k} domains {list(names)} (a Dirichlet "
                         f"cannot sample around a zero weight); got {p.tolist()}")
    p = p / p.sum()
    conc = float(k) if concentration is None else concentration
    if not conc > 0:
        raise ValueError(f"concentration must be positive (got {concentration})")
    if not 1 <= top_k <= num_samples:
        raise ValueError(f"top_k must be between 1 and num_samples={num_samples} (got {top_k})")
    rng = np.random.default_rng(seed)
    candidates = rng.dirichlet(conc * p, size=num_samples)
    predicted = fit.predict(candidates)
    top = candidates[np.argsort(predicted, kind="stable")[:top_k]]
    mean = top.mean(axis=0)
    mean = mean / mean.sum()
    tree = cKDTree(fit.trial_weights)
    nearest = float(tree.query(mean, p=1)[0])
    warnings = list(fit.warnings)
    # The largest nearest-neighbour L1 distance among trials: how sparsely the region is sampled.
    spacing = float(tree.query(fit.trial_weights, k=2, p=1)[0][:, 1].max())
    if nearest > spacing:
        warnings.append(f"the recommended mixture is {nearest:.3f} (L1) from the nearest trial, more than trials lie "
                        f"from each other ({spacing:.3f}): the regression extrapolates there; run a trial at it")
    return MixtureRecommendation(
        weights=dict(zip(names, mean.tolist(), strict=True)),
        predicted_loss=float(fit.predict(mean[None, :])[0]),
        top_k_spread=dict(zip(names, top.std(axis=0).tolist(), strict=True)),
        best_observed_loss=float(min(fit.targets)),
        nearest_trial_distance=nearest, num_samples=num_samples, top_k=top_k, warnings=tuple(warnings),
        extrapolates=nearest > spacing)


def _estimator(model: Model, num_trials: int, seed: int) -> Any:
    if model == "ridge":
        return make_pipeline(FunctionTransformer(_with_log_features), StandardScaler(),
                             RidgeCV(alphas=np.logspace(-6, 3, 19)))
    if model == "gbm":
        # Small data (tens to hundreds of trials): exact splits rather than histograms, shallow
        # trees, many small steps, leaves of a few trials each.
        return GradientBoostingRegressor(n_estimators=300, learning_rate=0.05, max_depth=3,
                                         min_samples_leaf=max(3, num_trials // 40), random_state=seed)
    raise AssertionError(model)


def _with_log_features(w: np.ndarray) -> np.ndarray:
    return np.hstack([w, np.log(w + LOG_EPS)])


def _weights_matrix(weights: Any, domains: Sequence[str] | None) -> tuple[np.ndarray, tuple[str, ...]]:
    rows = list(weights)
    if rows and isinstance(rows[0], Mapping):
        names = tuple(domains) if domains is not None else tuple(sorted({k for row in rows for k in row}))
        w = np.array([[float(row.get(name, 0.0)) for name in names] for row in rows])
        extra = {k for row in rows for k in row} - set(names)
        if extra:
            raise ValueError(f"weights name domains {sorted(extra)} missing from domains={list(names)}")
    else:
        w = np.asarray(rows, dtype=float)
        if w.ndim != 2:
            raise ValueError(f"weights must be one row of domain weights per trial (got shape {w.shape})")
        names = tuple(domains) if domains is not None else tuple(f"domain_{i}" for i in range(w.shape[1]))
        if len(names) != w.shape[1]:
            raise ValueError(f"{len(names)} domain names for {w.shape[1]} weight columns")
    if len(names) < 2:
        raise ValueError("a mixture needs at least 2 domains")
    if not np.all(np.isfinite(w) & (w >= 0)):
        raise ValueError("every mixture weight must be finite and >= 0")
    sums = w.sum(axis=1)
    off = np.flatnonzero(np.abs(sums - 1) > SIMPLEX_ATOL)
    if len(off):
        raise ValueError(f"mixture weights must sum to 1 per trial; trial {int(off[0])} sums to {sums[off[0]]:.6g} "
                         f"({len(off)} trials off the simplex): normalise them")
    return w, names


def _target(losses: Any, target: str, num_trials: int) -> tuple[np.ndarray, str]:
    if isinstance(losses, Mapping):
        table = {name: np.asarray(v, dtype=float) for name, v in losses.items()}
        if target == "average":
            y, name = np.mean(np.stack(list(table.values())), axis=0), f"average({', '.join(sorted(table))})"
        elif target in table:
            y, name = table[target], target
        else:
            raise ValueError(f"target {target!r} is not among the losses {sorted(table)} (or use 'average')")
    else:
        y, name = np.asarray(losses, dtype=float), "loss"
    if y.shape != (num_trials,):
        raise ValueError(f"the target loss needs one value per trial ({num_trials}); got shape {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError("the target loss has non-finite values; drop or rerun those trials")
    return y, name
