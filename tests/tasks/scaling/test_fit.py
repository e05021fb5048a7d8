"""Fit, mix and the validation gate: exact numbers on known inputs."""

import math

import pytest

from tasks.errors import ConfigError
from tasks.scaling.fit import FitConfig, fit_plan, fit_power_law, predict
from tasks.scaling.mix import MixConfig, build_mixture_manifest
from tasks.scaling.sweep import SweepConfig, TrialResult, design_trials
from tasks.scaling.validate import check_gate


def trial(width, lr, mixture, params, loss):
    return TrialResult(f"w{width}-lr{lr:g}-{mixture}-bs8", width, lr, mixture, 8, params + 100, params, loss, loss, {},
                       1000, 1.0)


def test_power_law_recovers_exact_parameters():
    params = [1e4, 3e4, 1e5, 3e5]
    law = fit_power_law(params, [5.0 * n ** -0.2 for n in params])
    assert law["A"] == pytest.approx(5.0) and law["alpha"] == pytest.approx(0.2)
    assert law["residual_sigma"] == pytest.approx(0.0, abs=1e-9)
    prediction = predict(law, 1e6, FitConfig(min_relative_interval=0.05))
    assert prediction["loss"] == pytest.approx(5.0 * 1e6 ** -0.2)
    assert prediction["high"] / prediction["loss"] == pytest.approx(1.05)  # the floor applies to a perfect fit


def test_plan_picks_best_lr_and_mixture_and_uses_best_lr_per_width():
    trials = [
        trial(64, 1e-3, "a", 1000, 4.0), trial(64, 3e-3, "a", 1000, 3.5), trial(64, 1e-3, "b", 1000, 3.9),
        trial(64, 3e-3, "b", 1000, 3.4),
        trial(32, 1e-3, "a", 400, 4.4), trial(32, 3e-3, "a", 400, 4.6),
        trial(96, 1e-3, "a", 2000, 3.3), trial(96, 3e-3, "a", 2000, 3.6),
    ]
    plan = fit_plan(FitConfig(), trials, 64, {"a": {"x": 1}, "b": {"x": 1, "y": 3}}, {"validate": 8000}, batch_size=8)
    assert plan["lr"] == 3e-3 and plan["mixture"]["name"] == "b"
    assert plan["mixture"]["weights"] == {"x": 0.25, "y": 0.75}
    assert [(p["width"], p["val_loss"]) for p in plan["size_points"]] == [(32, 4.4), (64, 3.5), (96, 3.3)]
    pred = plan["predictions"]["validate"]
    assert pred["low"] < pred["loss"] < pred["high"] and pred["loss"] < 3.3


def test_too_few_widths_means_no_power_law():
    trials = [trial(64, 1e-3, "a", 1000, 4.0), trial(32, 1e-3, "a", 400, 4.5)]
    plan = fit_plan(FitConfig(min_points_for_power_law=3), trials, 64, {"a": {"x": 1}}, {"validate": 8000},
                    batch_size=8)
    assert plan["power_law"] is None and plan["predictions"] == {}


def test_sweep_design_is_named_by_hyperparameters():
    cfg = SweepConfig(widths=[32, 64], lrs=[1e-3, 1e-2], mixtures={"u": {"web": 1}, "p": {"prose": 1}})
    names = [t.name for t in design_trials(cfg)]
    assert names == ["w64-lr0.001-u-bs8", "w64-lr0.01-u-bs8", "w64-lr0.001-p-bs8", "w64-lr0.01-p-bs8",
                     "w32-lr0.001-u-bs8", "w32-lr0.01-u-bs8"]


SHARDS = {"dtype": "uint16", "vocab_size": 500, "eos_id": 0, "domains": {
    "web": {"train": {"path": "shards/web/train.bin", "num_tokens": 1000}, "val": {"path": "shards/web/val.bin"}},
    "code": {"train": {"path": "shards/code/train.bin", "num_tokens": 100}, "val": {"path": "shards/code/val.bin"}},
}}


def test_mixture_manifest_budgets_and_epochs():
    manifest = build_mixture_manifest(MixConfig(), SHARDS, "tokenize/k", {"web": 3, "code": 1}, 800, 64)
    web, code = manifest["domains"]["web"], manifest["domains"]["code"]
    assert (web["weight"], web["token_budget"], web["epochs"]) == (0.75, 600, 0.6)
    assert (code["weight"], code["token_budget"], code["epochs"]) == (0.25, 200, 2.0)
    assert web["train"] == ["tokenize/k/shards/web/train.bin"]


def test_mixture_refuses_too_much_repetition():
    with pytest.raises(ConfigError, match="repeats domain 'code' 20.0 times.*mix.max_epochs"):
        build_mixture_manifest(MixConfig(max_epochs=10), SHARDS, "t", {"web": 0, "code": 1}, 2000, 64)


def test_gate_passes_inside_interval_and_explains_failures():
    curve = [(0, 6.0), (10, 4.0)]
    predicted = {"num_params": 10, "loss": 3.0, "low": 2.8, "high": 3.2}
    assert check_gate(3.1, curve, predicted).passed
    above = check_gate(3.5, curve, predicted)
    assert not above.passed and "above the prediction interval" in above.reasons[0]
    assert "FAILED" in above.describe()
    unstable = check_gate(math.nan, [(0, 6.0), (10, math.nan)], predicted)
    assert not unstable.passed and "NaN" in unstable.reasons[0]
    assert not check_gate(3.0, [(0, 4.0), (10, 4.5)], predicted).passed  # did not learn
    assert check_gate(3.0, curve, None).passed  # no prediction: stability only
