"""The fit and the plan on synthetic sweeps of known laws; the mixture manifest; the validation gate.

Synthetic IsoFLOP sweeps come from L(N, D) = 2.0 + 400/N^0.35 + 600/D^0.3 with log-normal noise
σ = 0.005: 5 budgets x 5 sizes around each budget's optimum, as `design_trials` lays them out.
Tolerances (α, β within 0.06; N* within 25%) are about 3 standard deviations over 10 seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.tasks.errors import ConfigError
from kiln.tasks.scaling.fit import (
    FitConfig,
    chosen_mixture,
    fit_laws,
    fit_mixture,
    hyper_at,
    laws_from_plan,
    loss_law_to_dict,
)
from kiln.tasks.scaling.laws import compute_optimal_allocation
from kiln.tasks.scaling.mix import MixConfig, build_mixture_manifest
from kiln.tasks.scaling.plan import (
    R_STAR_D,
    DataBudget,
    budget_from_accelerators,
    data_use,
    effective_tokens,
    parameters,
    plan_data_feasible,
    plan_for_compute,
    plan_for_model,
)
from kiln.tasks.scaling.sweep import IsoFlopBudget, MixtureDesign, SweepConfig, TrialResult
from kiln.tasks.scaling.transfer import transfer_spearman
from kiln.tasks.scaling.validate import ValidateConfig, check_gate
from kiln.tasks.train.config import ModelConfig, TrainRunConfig

TRUTH = {"E": 2.0, "A": 400.0, "B": 600.0, "alpha": 0.35, "beta": 0.3}
BUDGETS = (1e13, 3e13, 1e14, 3e14, 1e15)
REFERENCE = {"web": 0.5, "code": 0.5}


def law(n, d):
    return TRUTH["E"] + TRUTH["A"] / n ** TRUTH["alpha"] + TRUTH["B"] / d ** TRUTH["beta"]


def result(name, n, d, loss, *, budget=None, width=8, lr=0.01, batch=8, kind="isoflop", mixture="ref",
           weights=None, by_domain=None):
    return TrialResult(name, width, lr, mixture, batch, int(n), int(n) // 2, loss, loss, by_domain or {}, int(d), 1.0,
                       steps=int(d) // (batch * 64), kind=kind, budget=budget, weights=weights or REFERENCE,
                       tokens=int(d))


def isoflop_sweep(seed=0, sigma=0.005):
    """5 budgets x 5 sizes (width index 1..5, factors 1/4..4 of the true optimum), plus an LR grid at
    each budget's middle size whose best LR follows LR*(C) = 3e3 · C^-0.3."""
    rng = np.random.default_rng(seed)
    trials = []
    for c in BUDGETS:
        n_opt, _ = compute_optimal_allocation(c, TRUTH["A"], TRUTH["B"], TRUTH["alpha"], TRUTH["beta"])
        for i, factor in enumerate((0.25, 0.5, 1.0, 2.0, 4.0), start=1):
            n = n_opt * factor
            d = c / (6 * n)
            best_lr = 3e3 * c ** -0.3
            for lr in ((best_lr / 2, best_lr, best_lr * 2) if i == 3 else (best_lr,)):
                loss = law(n, d) * (1 + 0.02 * math.log(lr / best_lr) ** 2) * math.exp(rng.normal(0, sigma))
                trials.append(result(f"c{c:g}-w{i}-lr{lr:.3g}", n, d, loss, budget=c, width=i, lr=lr,
                                     kind="isoflop" if lr == best_lr else "hyper"))
    return trials


def sweep_config(**updates):
    return SweepConfig(**{"model": ModelConfig(d_model=8, n_layers=2, n_heads=4, max_seq_len=64),
                          "isoflop": [IsoFlopBudget(flops=c, widths=[2, 4, 6, 8, 10]) for c in BUDGETS],
                          "mixtures": {"ref": REFERENCE}, "mixture_design": MixtureDesign(num_samples=0),
                          "lr_width_exponent": 0.0, **updates})


@pytest.fixture(scope="module")
def fitted():
    sweep, trials = sweep_config(), isoflop_sweep()
    return sweep, trials, fit_laws(FitConfig(num_bootstrap=100), sweep, trials)


def test_the_laws_recover_a_known_sweep(fitted):
    _, trials, laws = fitted
    assert laws["refused"] == {}
    assert len(laws["points"]) == 25  # each (N, D) once, at its best LR
    law_fit = laws["loss_law"]
    assert law_fit.alpha == pytest.approx(TRUTH["alpha"], abs=0.06)
    assert law_fit.beta == pytest.approx(TRUTH["beta"], abs=0.06)
    for name in ("alpha", "beta"):
        low, high = law_fit.intervals[name]
        assert 0 < low <= TRUTH[name] <= high
    # approach 2 (parabola minima) and approach 3 (the law) agree on N*(C) with the truth
    n_true, _ = compute_optimal_allocation(3e15, TRUTH["A"], TRUTH["B"], TRUTH["alpha"], TRUTH["beta"])
    assert float(laws["isoflop"].n_law.predict(3e15)) == pytest.approx(n_true, rel=0.25)
    assert law_fit.compute_optimal([3e15]).n_opt[0] == pytest.approx(n_true, rel=0.25)
    # LR*(C) through the grid's best points
    assert laws["hyper"].lr_law.exponent == pytest.approx(-0.3, abs=0.05)


def test_the_plan_follows_the_laws_and_predicts_with_a_bootstrap_interval(fitted):
    sweep, trials, laws = fitted
    run = plan_for_compute(1e15, sweep, 64, laws["loss_law"], laws["isoflop"], laws["hyper"], trials)
    law_fit = laws["loss_law"]
    # the family's width nearest N*: a shape of the proxies' depth and head size
    assert run["model"]["n_layers"] == 2 and run["model"]["d_model"] % sweep.model.head_dim == 0
    assert run["tokens"] == pytest.approx(1e15 / (6 * run["num_params"]), rel=1e-6)
    assert run["steps"] * run["batch_size"] * run["seq_len"] == pytest.approx(run["tokens"], rel=0.01)
    assert run["lr"] == pytest.approx(3e3 * 1e15 ** -0.3, rel=0.15) and run["lr_interval"][0] < run["lr"]
    low, high = run["interval"]
    truth = law(run["num_params"], run["tokens"])
    assert low < run["predicted_loss"] < high and low < truth < high
    assert run["predicted_loss"] == pytest.approx(float(law_fit.predict(run["num_params"], run["tokens"])))
    # the interval is the bootstrap's, not a floor: a few noise sigmas wide, not 5%
    assert (high - low) / run["predicted_loss"] < 0.04
    # what `kiln plan --budget` reads back from plan.json gives the same run
    plan = {"loss_law": loss_law_to_dict(law_fit), "isoflop": laws["isoflop"].as_dict(),
            "hyperparameter_laws": laws["hyper"].as_dict()}
    again = plan_for_compute(1e15, sweep, 64, *laws_from_plan(plan), trials)
    assert again == run


def test_a_fixed_model_gets_its_prediction_and_the_compute_optimal_size_beside_it(fitted):
    sweep, trials, laws = fitted
    model = ModelConfig(d_model=16, n_layers=2, n_heads=8, max_seq_len=64)
    run = plan_for_model(model, 2_000_000, 8, 64, sweep, 64, laws["loss_law"], laws["hyper"], trials)
    assert run["steps"] == round(2_000_000 / (8 * 64)) and run["planned_batch_size"] >= 1
    assert run["compute"] == pytest.approx(6 * run["num_params"] * 2_000_000)
    assert "n_opt" in run and run["interval"][0] < run["predicted_loss"] < run["interval"][1]


def test_repeated_tokens_count_as_muennighoffs_effective_data():
    """D' = U + U R* (1 - exp(-R/R*)), R* = 15.4: fresh tokens count fully, 4 epochs about 3.7 fresh ones,
    40 epochs about 15, and no number of repeats more than U (1 + R*)."""
    assert R_STAR_D == 15.4
    assert effective_tokens(50, 100) == 50 and effective_tokens(100, 100) == 100
    assert effective_tokens(400, 100) == pytest.approx(372.6, abs=0.1)
    assert effective_tokens(4000, 100) == pytest.approx(1517.6, abs=0.1)
    assert effective_tokens(1e4, 100) < effective_tokens(1e12, 100) == pytest.approx(100 * (1 + R_STAR_D))
    data = DataBudget({"web": 100, "code": 1000, "empty": 0}, {"web": 0.5, "code": 0.5, "empty": 0.0}, max_epochs=4)
    use = data_use(800, data)
    assert use["domains"]["web"] == {"tokens": 400, "epochs": 4.0, "effective_tokens": effective_tokens(400, 100)}
    assert use["domains"]["code"]["epochs"] == 0.4 and use["domains"]["empty"]["epochs"] == 0.0
    assert (use["most_repeated"], use["max_epochs"], use["within_max_epochs"]) == ("web", 4.0, True)
    assert use["effective_tokens"] == pytest.approx(372.6 + 400, abs=0.1)
    assert not data_use(801, data)["within_max_epochs"]
    # a domain with weight and no tokens is repeated infinitely often: never within any limit
    starved = DataBudget({"web": 100, "code": 0}, {"web": 0.5, "code": 0.5}, max_epochs=4)
    assert data_use(10, starved)["max_epochs"] == math.inf and not data_use(10, starved)["within_max_epochs"]


def test_the_data_feasible_plan_never_repeats_more_than_allowed_and_says_why(fitted):
    sweep, trials, laws = fitted
    law_fit, hyper = laws["loss_law"], laws["hyper"]
    fresh = plan_for_compute(1e15, sweep, 64, law_fit, laws["isoflop"], hyper, trials)
    plentiful = DataBudget({"web": fresh["tokens"], "code": fresh["tokens"]}, REFERENCE, max_epochs=4)
    optimal = plan_for_compute(1e15, sweep, 64, law_fit, laws["isoflop"], hyper, trials, plentiful)
    # data enough for every token to be fresh: the compute-optimal run is the plan, and D' = D
    assert optimal["effective_tokens"] == optimal["tokens"] and optimal["predicted_loss"] == fresh["predicted_loss"]
    planned = plan_data_feasible(1e15, sweep, 64, law_fit, hyper, trials, plentiful, optimal)
    assert {k: v for k, v in planned.items() if k != "chosen_because"} == optimal
    # a twentieth of that: the compute-optimal run would see each domain 10 times
    scarce = DataBudget({"web": fresh["tokens"] // 20, "code": fresh["tokens"] // 20}, REFERENCE, max_epochs=4)
    optimal = plan_for_compute(1e15, sweep, 64, law_fit, laws["isoflop"], hyper, trials, scarce)
    assert optimal["data"]["max_epochs"] == pytest.approx(10, rel=0.01) and not optimal["data"]["within_max_epochs"]
    assert optimal["predicted_loss"] > fresh["predicted_loss"]  # repeated tokens are worth less
    planned = plan_data_feasible(1e15, sweep, 64, law_fit, hyper, trials, scarce, optimal)
    assert planned["data"]["within_max_epochs"] and planned["data"]["max_epochs"] <= 4
    assert planned["num_params"] > optimal["num_params"] and planned["compute"] == 1e15
    assert "repeats web 10.0 times, over mix.max_epochs=4" in planned["chosen_because"]  # equal shares: the first
    # the best feasible width: its neighbours in the family predict no lower loss (or repeat too much)
    head = sweep.model.head_dim
    for width in (planned["width"] - head, planned["width"] + head):
        model = ModelConfig(**{**planned["model"], "d_model": width, "n_heads": width // head})
        other = plan_for_model(model, round(1e15 / (6 * parameters(model, 64))), planned["batch_size"], 64, sweep, 64,
                               law_fit, hyper, trials, scarce)
        assert not other["data"]["within_max_epochs"] or other["predicted_loss"] >= planned["predicted_loss"] - 1e-3
    # no data at all: refused, saying why and what to do
    with pytest.raises(ValueError, match="no model of the family trains 1e\\+15 FLOPs within mix.max_epochs=4"):
        starved = DataBudget({"web": 1, "code": 1}, REFERENCE, max_epochs=4)
        plan_data_feasible(1e15, sweep, 64, law_fit, hyper, trials, starved,
                           plan_for_compute(1e15, sweep, 64, law_fit, laws["isoflop"], hyper, trials, starved))


def test_too_few_points_refuse_the_law_and_say_what_is_missing():
    sweep = sweep_config(isoflop=[IsoFlopBudget(flops=c, widths=[2, 4]) for c in BUDGETS[:2]])
    trials = [t for t in isoflop_sweep() if t.budget in BUDGETS[:2] and t.width in (2, 4)]
    laws = fit_laws(FitConfig(num_bootstrap=20), sweep, trials)
    assert laws["loss_law"] is None and "at least 10 points" in laws["refused"]["loss_law"]
    assert "3 compute budgets" in laws["refused"]["isoflop"] and "3 or more compute budgets" in laws["refused"]["hyper"]
    with pytest.raises(ValueError, match="no loss law"):
        plan_for_compute(1e15, sweep, 64, None, None, None, trials)
    # without an LR law the run takes the best trial of the nearest budget, moved to its width by the rule
    ruled = sweep_config(lr_width_exponent=1.0)
    hp = hyper_at(None, trials, ruled, 1e15, width=8)
    best = min((t for t in trials if t.budget == BUDGETS[1]), key=lambda t: t.val_loss)
    assert hp["lr"] == pytest.approx(best.lr * best.width / 8) and "best trial" in hp["source"]


def test_a_budget_in_accelerator_hours_uses_the_assumed_mfu():
    assert budget_from_accelerators(8, 24, 989.0, 0.4) == pytest.approx(8 * 24 * 3600 * 989e12 * 0.4)
    with pytest.raises(ValueError, match="accelerators > 0"):
        budget_from_accelerators(0, 24, 989.0, 0.4)


def mixture_trials(num, seed=0, noise=0.002, informative=True):
    """Mixture trials over 3 domains whose average loss is lowest at w* = (0.5, 0.3, 0.2)."""
    rng = np.random.default_rng(seed)
    optimum = np.array([0.5, 0.3, 0.2])
    out = []
    for i, w in enumerate(rng.dirichlet([2.0, 2.0, 2.0], size=num)):
        loss = (3.0 - 0.4 * (optimum * np.log(w + 1e-3)).sum() if informative else 3.0) + rng.normal(0, noise)
        weights = dict(zip(("code", "prose", "web"), w.tolist(), strict=True))
        out.append(result(f"dirichlet{i:02d}", 1e4, 1e5, float(loss), kind="mixture", mixture=f"dirichlet{i:02d}",
                          weights=weights, by_domain={"web": float(loss) + 0.1}))
    return out


def test_the_mixture_regression_recovers_a_known_optimum_and_ranks_held_out_trials():
    sweep = sweep_config(mixtures={"ref": {"web": 1, "code": 1, "prose": 1}},
                         mixture_design=MixtureDesign(num_samples=40, concentration=6.0))
    mixture = fit_mixture(FitConfig(), sweep, mixture_trials(40))
    assert mixture["refused"] is None and mixture["heldout_spearman"] > 0.8
    assert set(mixture["models"]) == {"ridge", "gbm"} and mixture["chosen"] in ("ridge", "gbm")
    chosen = chosen_mixture(mixture)
    assert chosen["source"] == "regression"
    assert [chosen["weights"][d] for d in ("web", "code", "prose")] == pytest.approx([0.2, 0.5, 0.3], abs=0.07)
    # validate's transfer check reads what the regression predicts for each trial and for its optimum
    predictions = mixture["predictions"]
    assert set(predictions) == {f"dirichlet{i:02d}" for i in range(40)} | {f"regression-{mixture['chosen']}"}
    assert predictions[f"regression-{mixture['chosen']}"] == {
        "weights": mixture["recommendation"]["weights"], "predicted_loss": mixture["recommendation"]["predicted_loss"]}
    observed = {t.mixture: t.val_loss for t in mixture_trials(40)}
    assert transfer_spearman({n: p["predicted_loss"] for n, p in predictions.items()}, observed) > 0.9
    domain = fit_mixture(FitConfig(mixture_target="web", mixture_model="ridge"), sweep, mixture_trials(40))
    assert domain["chosen"] == "ridge" and domain["target"] == "web"


def test_an_optimum_outside_the_trials_is_not_bet_on():
    # trials crowd one corner; the loss falls towards the other: the regression's optimum lies where no trial is
    sweep = sweep_config(mixtures={"ref": {"web": 1, "code": 1, "prose": 1}},
                         mixture_design=MixtureDesign(num_samples=40, concentration=3.0))
    rng = np.random.default_rng(0)
    trials = []
    for i, w in enumerate(rng.dirichlet([60.0, 5.0, 5.0], size=30)):
        weights = dict(zip(("code", "prose", "web"), w.tolist(), strict=True))
        loss = 3.0 - weights["web"] + rng.normal(0, 1e-3)
        trials.append(result(f"d{i}", 1e4, 1e5, loss, kind="mixture", mixture=f"d{i}", weights=weights))
    mixture = fit_mixture(FitConfig(mixture_model="ridge"), sweep, trials)
    assert mixture["recommendation"]["extrapolates"] and "outside the region the trials cover" in mixture["refused"]
    assert chosen_mixture(mixture)["source"] == "best observed trial"


def test_an_unreliable_mixture_regression_falls_back_to_the_best_observed_trial():
    sweep = sweep_config(mixtures={"ref": {"web": 1, "code": 1, "prose": 1}})
    trials = mixture_trials(30, informative=False, noise=0.01)
    mixture = fit_mixture(FitConfig(), sweep, trials)
    assert "held-out Spearman" in mixture["refused"]
    chosen = chosen_mixture(mixture)
    best = min(trials, key=lambda t: t.val_loss)
    assert chosen == {"name": best.mixture, "weights": best.weights, "source": "best observed trial",
                      "observed_loss": best.val_loss}
    few = fit_mixture(FitConfig(), sweep, trials[:5])
    assert "at least 20 trials" in few["refused"] and chosen_mixture(few)["source"] == "best observed trial"
    assert few["predictions"] == {}  # nothing for validate's transfer check to rank


SHARDS = {"dtype": "uint16", "vocab_size": 500, "eos_id": 0, "domains": {
    "web": {"train": {"shards": [{"path": "shards/web/train/00000.bin"}, {"path": "shards/web/train/00001.bin"}],
                      "num_tokens": 1000}, "val": {"shards": [{"path": "shards/web/val/00001.bin"}]}},
    "code": {"train": {"shards": [{"path": "shards/code/train/00000.bin"}], "num_tokens": 100},
             "val": {"shards": []}},
}}


def test_mixture_manifest_budgets_and_epochs():
    manifest = build_mixture_manifest(MixConfig(), SHARDS, "tokenize/k", {"web": 3, "code": 1}, 800, 64)
    web, code = manifest["domains"]["web"], manifest["domains"]["code"]
    assert (web["weight"], web["token_budget"], web["epochs"]) == (0.75, 600, 0.6)
    assert (code["weight"], code["token_budget"], code["epochs"]) == (0.25, 200, 2.0)
    assert web["train"] == ["tokenize/k/shards/web/train/00000.bin", "tokenize/k/shards/web/train/00001.bin"]
    assert (web["val"], code["val"]) == (["tokenize/k/shards/web/val/00001.bin"], [])


def test_mixture_refuses_too_much_repetition():
    with pytest.raises(ConfigError, match="repeats domain 'code' 20.0 times.*mix.max_epochs"):
        build_mixture_manifest(MixConfig(max_epochs=10), SHARDS, "t", {"web": 0, "code": 1}, 2000, 64)


PREDICTED = {"loss": 3.0, "low": 2.95, "high": 3.05, "level": 0.95, "num_params": 10_000, "tokens": 100_000}


def test_the_gate_passes_a_right_prediction_and_fails_a_wrong_one():
    curve = [(1, 6.0), (10, 4.0)]
    assert check_gate(3.02, curve, PREDICTED).passed
    above = check_gate(3.2, curve, PREDICTED)
    assert not above.passed and "above the 95% prediction interval [2.9500, 3.0500]" in above.reasons[0]
    assert "FAILED" in above.describe() and above.checks["inside_interval"] is False
    # the same observation against a sweep's wrong prediction (a law that does not transfer)
    wrong = {**PREDICTED, "loss": 2.5, "low": 2.45, "high": 2.55}
    assert "above" in check_gate(3.02, curve, wrong).reasons[0]
    unstable = check_gate(math.nan, [(1, 6.0), (10, math.nan)], PREDICTED)
    assert not unstable.passed and "NaN" in unstable.reasons[0]
    assert not check_gate(3.0, [(1, 4.0), (10, 4.5)], PREDICTED).passed  # did not learn
    assert check_gate(3.0, curve, None).passed  # no prediction: stability only, and the report says so
    assert "no prediction to check" in check_gate(3.0, curve, None).describe()


def test_the_gate_counts_spikes_and_gradient_blow_ups():
    curve = [(1, 6.0), (10, 3.0)]
    spikes = [{"kind": "spike", "step": 7}]
    assert "1 loss spikes" in check_gate(3.0, curve, PREDICTED, health_events=spikes).reasons[0]
    assert check_gate(3.0, curve, PREDICTED, health_events=spikes, cfg=ValidateConfig(max_spikes=1)).passed
    norms = [(s, 1.0) for s in range(1, 40)] + [(40, 50.0)]
    blown = check_gate(3.0, curve, PREDICTED, grad_norm_curve=norms, warmup_steps=5)
    assert not blown.passed and "gradient norm reached 50.0x" in blown.reasons[0]
    # a large norm during warmup is expected and not counted
    early = [(1, 80.0)] + [(s, 1.0) for s in range(2, 40)]
    assert check_gate(3.0, curve, PREDICTED, grad_norm_curve=early, warmup_steps=5).passed


def test_validate_runs_longer_than_the_default_proxy():
    assert ValidateConfig().run.steps > TrainRunConfig().steps // 2
