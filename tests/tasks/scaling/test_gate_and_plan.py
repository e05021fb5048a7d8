"""Production behind the gate, and the train stage following the plan: what it refuses, what it
records (the override, the departures), straight from the stage functions with real configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.ledger import StageRecorder
from kiln.tasks.scaling.fit import PLAN_FILE
from kiln.tasks.scaling.validate import REPORT_FILE, ValidationGateError, check_gate
from kiln.tasks.stage import StageContext
from kiln.tasks.stages.train import check_gate_passed, planned_run
from kiln.tasks.store import Store
from tests.tasks.scaling.test_sweep import RecordingTracker

PRODUCTION = {"model": {"d_model": 24, "n_layers": 2, "n_heads": 12, "max_seq_len": 64}, "tokens": 1_024_000,
              "batch_size": 16, "seq_len": 64, "steps": 1000, "lr": 0.03}
PREDICTED = {"loss": 3.0, "low": 2.95, "high": 3.05, "level": 0.95, "num_params": 10_000, "tokens": 100_000}


def context(tmp_path: Path, overrides: list[str], gate_passed_at: float | None = None) -> tuple[StageContext, RecordingTracker]:
    """A train-stage context whose fit plan is PRODUCTION and whose validate gate saw `gate_passed_at`."""
    cfg = load_config("configs/default.yaml", [f"work_dir={tmp_path}", *overrides])
    fit, validate = tmp_path / "fit", tmp_path / "validate"
    fit.mkdir(parents=True)
    validate.mkdir(parents=True)
    (fit / PLAN_FILE).write_text(json.dumps({"lr": 0.03, "runs": {"production": PRODUCTION}, "refused": {},
                                             "loss_law": None}))
    report = check_gate(gate_passed_at if gate_passed_at is not None else 3.3, [(1, 6.0), (9, 3.0)], PREDICTED)
    (validate / REPORT_FILE).write_text(json.dumps(report.as_dict()))
    tracker = RecordingTracker()
    tracker.start_run("train", tags={})
    ctx = StageContext(cfg, tmp_path / "out", {"fit": fit, "validate": validate}, Store(tmp_path / "store"),
                       StageRecorder(tracker, "train", "train", "k"))
    return ctx, tracker


def test_production_refuses_a_failed_gate_unless_overridden_and_records_the_override(tmp_path):
    ctx, _ = context(tmp_path / "a", [], gate_passed_at=3.3)
    with pytest.raises(ValidationGateError, match=r"(?s)gate failed.*above the 95% prediction interval.*"
                                                  r"train.gate_override"):
        check_gate_passed(ctx)
    ctx, tracker = context(tmp_path / "b", ["train.gate_override='a one-off: data changed since the sweep'"],
                           gate_passed_at=3.3)
    assert check_gate_passed(ctx) == {"gate_passed": False,
                                      "gate_override": "a one-off: data changed since the sweep"}
    assert tracker.runs["train"]["tags"]["kiln.gate_override"] == "a one-off: data changed since the sweep"
    ctx, _ = context(tmp_path / "c", [], gate_passed_at=3.0)
    assert check_gate_passed(ctx) == {"gate_passed": True}


def test_train_follows_the_plan_and_records_what_departs_from_it(tmp_path):
    # default.yaml leaves train.model, steps, batch and context to the plan: it is the plan's run exactly
    ctx, _ = context(tmp_path / "p", [], gate_passed_at=3.0)
    model, run, departures = planned_run(ctx)
    assert (model.d_model, model.n_layers, model.n_heads, run.seq_len) == (24, 2, 12, 64)
    assert (run.steps, run.batch_size, departures) == (1000, 16, {})
    # steps, batch and context set in the config stay, the shape comes from the plan
    ctx, _ = context(tmp_path / "a", ["train.run.steps=300", "train.run.batch_size=8", "train.run.seq_len=128"],
                     gate_passed_at=3.0)
    model, run, departures = planned_run(ctx)
    assert (model.d_model, model.n_layers, model.n_heads) == (24, 2, 12)
    assert model.max_seq_len == run.seq_len == 128  # the train context, which the plan's model must hold
    assert (run.steps, run.batch_size) == (300, 8)
    assert departures["tokens"] == {"plan": 1_024_000, "config": 300 * 8 * 128}
    assert not any(k.startswith("model.") for k in departures)
    # a hand-picked model is a departure too, recorded field by field
    ctx, _ = context(tmp_path / "b", ["train.model={d_model: 96, n_layers: 4, n_heads: 6, max_seq_len: 128}"],
                     gate_passed_at=3.0)
    _, _, departures = planned_run(ctx)
    assert departures["model.d_model"] == {"plan": 24, "config": 96}


def test_a_run_that_leaves_steps_and_batch_to_the_plan_gets_the_plans_tokens(tmp_path):
    ctx, _ = context(tmp_path, [], gate_passed_at=3.0)
    # as a config without train.run.steps / batch_size: the plan's 16 x 64-token sequences become 8 of 128
    ctx.cfg = ctx.cfg.model_copy(update={"train": ctx.cfg.train.model_copy(update={
        "run": type(ctx.cfg.train.run)(seq_len=128, eval_batches=2)})})
    _, run, departures = planned_run(ctx)
    assert (run.batch_size, run.steps) == (8, 1000) and departures == {}


def test_train_model_plan_without_a_production_plan_says_what_is_missing(tmp_path):
    ctx, _ = context(tmp_path, [], gate_passed_at=3.0)
    (ctx.inputs["fit"] / PLAN_FILE).write_text(json.dumps({"lr": 0.03, "runs": {}, "loss_law": None, "refused": {
        "production": "fit.budget_flops is null: no production budget to plan for"}}))
    with pytest.raises(ConfigError, match="budget_flops is null"):
        planned_run(ctx)


def test_train_says_where_it_landed_and_in_words_why_it_is_not_below_validate():
    from kiln.tasks.stages.train import against_validate, headline, landed

    stats = {"steps": 3289, "tokens_seen": 1_683_968, "num_params": 118_750, "final_train_loss": 5.0,
             "val_loss": 5.3, "predicted_val_loss": 5.16, "predicted_interval": [4.91, 5.62], "num_rollbacks": 0,
             "plan_departures": {}, "max_epochs": 9.6, "effective_tokens": 1_504_403, "prediction_comparable": True}
    plan = {"runs": {"validate": {"compute": 2.0e10, "predicted_loss": 6.12}}}
    validate = {"val_loss": 6.18, "tokens_seen": 118_784}
    stats |= landed(stats)
    stats |= against_validate(stats, validate, plan)
    assert (stats["landed"], stats["at_most_validate"], "why_not_below_validate" in stats) == ("inside", True, False)
    assert headline(stats) == {"steps": 3289, "tokens": 1_683_968, "params": 118_750, "train_loss": 5.0,
                                    "val_loss": 5.3, "predicted": "5.1600 [4.9100, 5.6200]", "landed": "inside",
                                    "vs_validate": "<= 6.1800"}
    # above its interval and above validate: the report says why in words
    worse = stats | {"val_loss": 6.4}
    worse |= landed(worse)
    worse |= against_validate(worse, validate, plan)
    assert worse["landed"] == "above" and not worse["at_most_validate"]
    assert worse["why_not_below_validate"] == (
        "the production model's validation loss 6.4000 is above the validate run's 6.1800: it repeated its data up "
        "to 9.6 times, so its 1,683,968 tokens count as 1,504,403 effective ones; the law predicted it better "
        "(5.1600 against 6.1200) and it landed above: the law's extrapolation to this size did not hold")
    assert headline(worse)["vs_validate"] == "> 6.1800" and headline(worse)["landed"] == "above"
