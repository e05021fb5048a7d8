"""The gate's capability trend (the mid-scale model against the sweep's best proxies on the eval
suite) and the mixture-transfer check, on constructed numbers with exact expectations; the validate
stage refusing unknown capability tasks before it trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.runner import run_stage
from kiln.tasks.scaling.capabilities import (
    CapabilityConfig,
    ScoredModel,
    capability_trend,
    primary_metrics,
)
from kiln.tasks.scaling.transfer import (
    MixtureTransferConfig,
    choose_transfer_mixtures,
    transfer_spearman,
)
from kiln.tasks.scaling.validate import ValidateConfig, check_gate
from kiln.tasks.store import FAILURE_FILE, Store
from tests.fixtures.validate_inputs import KEYS, commit_validate_inputs

REPO = Path(__file__).resolve().parents[3]

CURVE = [(1, 6.0), (10, 3.0)]
# bits per byte falls by 0.2 per doubling of compute; accuracy rises
PROXIES = [ScoredModel("p1", 1e9, {"kiln_heldout/bits_per_byte": 3.0, "kiln_heldout/word_perplexity": 90.0,
                                   "kiln_heldout_choice/acc": 0.3, "kiln_heldout_choice/acc_norm": 0.3}),
           ScoredModel("p2", 2e9, {"kiln_heldout/bits_per_byte": 2.8, "kiln_heldout/word_perplexity": 80.0,
                                   "kiln_heldout_choice/acc": 0.4, "kiln_heldout_choice/acc_norm": 0.4}),
           ScoredModel("p3", 4e9, {"kiln_heldout/bits_per_byte": 2.6, "kiln_heldout/word_perplexity": 70.0,
                                   "kiln_heldout_choice/acc": 0.5, "kiln_heldout_choice/acc_norm": 0.5})]


def midscale(bpb: float, acc_norm: float = 0.6) -> ScoredModel:
    return ScoredModel("validate", 1e10, {"kiln_heldout/bits_per_byte": bpb, "kiln_heldout/word_perplexity": 60.0,
                                          "kiln_heldout_choice/acc": 0.6, "kiln_heldout_choice/acc_norm": acc_norm})


def test_primary_metrics_are_one_per_task():
    assert primary_metrics(PROXIES[0].metrics) == ["kiln_heldout/bits_per_byte", "kiln_heldout_choice/acc_norm"]


def test_a_midscale_model_that_continues_the_proxies_trend_passes():
    rows, reasons = capability_trend(PROXIES[::-1], midscale(2.5), CapabilityConfig())  # any order in
    assert reasons == []
    bpb, acc = rows
    assert bpb.metric == "kiln_heldout/bits_per_byte" and not bpb.higher_is_better and bpb.gated
    assert [c for _, c, _ in bpb.proxies] == [1e9, 2e9, 4e9]
    assert (bpb.best_proxy, bpb.best_proxy_value, bpb.midscale, bpb.continues) == ("p3", 2.6, 2.5, True)
    # the proxies' line: -0.2 per doubling = -0.2 / log10(2) per decade, 3.0 at 1e9, so 3.0 + slope at 1e10
    assert bpb.slope_per_decade == pytest.approx(-0.2 / math.log10(2), abs=1e-12)
    assert bpb.trend_at_midscale == pytest.approx(3.0 - 0.2 / math.log10(2), abs=1e-12)
    assert (acc.metric, acc.higher_is_better, acc.gated, acc.best_proxy_value, acc.continues) == (
        "kiln_heldout_choice/acc_norm", True, False, 0.5, True)
    report = check_gate(3.0, CURVE, None, capabilities=(rows, reasons))
    assert report.passed and report.checks["capabilities_continue"] is True
    assert report.capabilities[0]["best_proxy"] == "p3"
    assert ("kiln_heldout/bits_per_byte: proxies 3.0000 @ 1e+09, 2.8000 @ 2e+09, 2.6000 @ 4e+09 FLOPs; mid-scale "
            "2.5000 @ 1e+10 (continues the trend vs best proxy 2.6000)") in report.describe()


def test_the_model_on_the_plans_mixture_is_shown_beside_not_gated():
    # less prose in the plan's mixture: worse prose bits per byte, which is the mixture, not a broken trend
    rows, reasons = capability_trend(PROXIES, midscale(2.5), CapabilityConfig(), plan_model=midscale(2.9, 0.1))
    assert reasons == [] and [(r.continues, r.plan_mixture) for r in rows] == [(True, 2.9), (True, 0.1)]
    assert "(continues the trend vs best proxy 2.6000); on the plan's mixture 2.9000" in check_gate(
        3.0, CURVE, None, capabilities=(rows, reasons)).describe()


def test_a_midscale_model_worse_than_the_best_proxy_fails_the_gate_and_says_why():
    rows, reasons = capability_trend(PROXIES, midscale(2.7), CapabilityConfig())
    assert [r.continues for r in rows] == [False, True]
    assert reasons == [
        "kiln_heldout/bits_per_byte of the mid-scale model is 2.7000, higher (worse) than the best proxy's 2.6000 "
        "(p3) with 2.5x its compute (validate.capabilities.tolerance=0.01): the proxies' capability trend does not "
        "continue at this size; look for what the larger model sees differently (context, tokenizer, data) before "
        "production"]
    report = check_gate(3.0, CURVE, None, capabilities=(rows, reasons))
    assert not report.passed and report.reasons == reasons and report.checks["capabilities_continue"] is False
    assert "(BREAKS the trend vs best proxy 2.6000)" in report.describe()


def with_items(model: ScoredModel, bpb_stderr: float, task: str = "kiln_heldout") -> ScoredModel:
    """`model` with what its results say of the items: the held-out bits per byte's standard error."""
    return ScoredModel(model.name, model.compute, model.metrics,
                       {task: {"level": "proxy", "chance": None, "stderr": bpb_stderr},
                        "kiln_heldout_choice": {"level": "mid", "chance": 0.25, "stderr": 0.15}})


def test_only_a_trusted_task_decides_the_gate_and_the_report_says_so():
    trust = CapabilityConfig().trust
    # Proxies 0.4 apart (3.0 .. 2.6), steadily better with compute. Items' standard error 0.05: SNR 8, trusted;
    # a mid-scale model worse than the best proxy fails the gate.
    proxies = [with_items(p, 0.05) for p in PROXIES]
    rows, reasons = capability_trend(proxies, with_items(midscale(2.7), 0.05), CapabilityConfig(), trust=trust)
    bpb, acc = rows
    assert bpb.trusted is True and bpb.trust["snr"] == pytest.approx(8.0) and bpb.trust["monotonicity"] == 1.0
    assert len(reasons) == 1 and not check_gate(3.0, CURVE, None, capabilities=(rows, reasons)).passed
    # The choice task: signal 0.2 over a standard error of 0.15 (SNR 1.33 < 2): not trusted (it is not gated anyway).
    assert acc.trusted is False and acc.trust["reasons"] == ["SNR 1.33 < 2.0"]
    # Noisy items (standard error 0.25 on the mid-scale model, the largest counts): SNR 1.6 < 2, so the same
    # broken trend decides nothing; the gate passes and its report says which metric it left out and why.
    rows, reasons = capability_trend(proxies, with_items(midscale(2.7), 0.25), CapabilityConfig(), trust=trust)
    assert rows[0].trusted is False and rows[0].trust["reasons"] == ["SNR 1.60 < 2.0"] and reasons == []
    report = check_gate(3.0, CURVE, None, capabilities=(rows, reasons))
    assert report.passed and report.checks["capabilities_continue"] is True
    assert report.checks["capabilities_not_trusted"] == ["kiln_heldout/bits_per_byte"]
    text = report.describe()
    assert "(BREAKS the trend vs best proxy 2.6000; not trusted: decides nothing)" in text
    assert "      not trusted: SNR 1.60 < 2.0" in text
    assert "gated metrics of tasks not trusted at this size, left out of the gate: kiln_heldout/bits_per_byte" in text
    # Proxies that do not improve with compute (Spearman -0.5 < 0.5) are not trusted either.
    flat = [ScoredModel(p.name, p.compute, {**p.metrics, "kiln_heldout/bits_per_byte": v}, with_items(p, 0.01).items)
            for p, v in zip(PROXIES, [2.8, 2.6, 2.9], strict=True)]
    rows, reasons = capability_trend(flat, with_items(midscale(3.5), 0.01), CapabilityConfig(), trust=trust)
    assert rows[0].trust["reasons"] == ["monotonicity (Spearman vs compute) -0.50 < 0.5"] and reasons == []
    # Without item scores (or without thresholds) a row is not judged and gates as before.
    rows, reasons = capability_trend(PROXIES, midscale(2.7), CapabilityConfig(), trust=trust)
    assert rows[0].trusted is None and len(reasons) == 1


def test_the_gate_report_shows_each_tasks_decision_accuracy():
    decisions = {"mixtures": ["a", "b", "uniform"], "pairs": 3,
                 "by_task": {"kiln_heldout/bits_per_byte": 2 / 3, "kiln_heldout_choice/acc_norm": None}}
    report = check_gate(3.0, CURVE, None, decision_accuracy=decisions)
    assert report.as_dict()["decision_accuracy"] == decisions
    assert ("  decision accuracy (the order of 3 mixtures at the sweep's size holding at this size, 3 pairs): "
            "kiln_heldout/bits_per_byte 0.67, kiln_heldout_choice/acc_norm –") in report.describe()


def test_the_tolerance_is_relative_to_the_best_proxy():
    # 2.6 x 1.02 = 2.652
    assert capability_trend(PROXIES, midscale(2.65), CapabilityConfig(tolerance=0.02))[1] == []
    assert len(capability_trend(PROXIES, midscale(2.66), CapabilityConfig(tolerance=0.02))[1]) == 1
    assert len(capability_trend(PROXIES, midscale(2.65), CapabilityConfig(tolerance=0))[1]) == 1
    assert capability_trend(PROXIES, midscale(2.626), CapabilityConfig())[1] == []  # the default 1 %


def test_an_ungated_metric_that_breaks_its_trend_is_reported_not_failed():
    rows, reasons = capability_trend(PROXIES, midscale(2.5, acc_norm=0.2), CapabilityConfig())
    assert reasons == [] and rows[1].continues is False
    assert "(BREAKS the trend vs best proxy 0.5000; not gated)" in check_gate(
        3.0, CURVE, None, capabilities=(rows, reasons)).describe()
    # gated, the same accuracy fails: lower is worse for it
    rows, reasons = capability_trend(PROXIES, midscale(2.5, acc_norm=0.2),
                                     CapabilityConfig(gated_metrics=["bits_per_byte", "acc_norm"]))
    assert len(reasons) == 1 and reasons[0].startswith("kiln_heldout_choice/acc_norm of the mid-scale model is "
                                                       "0.2000, lower (worse) than the best proxy's 0.5000 (p3)")


def test_one_proxy_gives_no_trend_line_and_metrics_a_proxy_lacks_are_left_out():
    lone = ScoredModel("p", 1e9, {"kiln_heldout/bits_per_byte": 3.0})
    rows, reasons = capability_trend([lone], midscale(2.9), CapabilityConfig())
    assert [r.metric for r in rows] == ["kiln_heldout/bits_per_byte"] and reasons == []
    assert rows[0].slope_per_decade is None and rows[0].trend_at_midscale is None
    assert capability_trend([], midscale(2.9), CapabilityConfig()) == ([], [])


def test_transfer_spearman_is_exact_on_constructed_orders():
    predicted = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    # one swapped neighbour pair: 1 - 6 * 2 / (4 * 15)
    assert transfer_spearman(predicted, {"a": 1.1, "b": 1.3, "c": 1.2, "d": 1.5}) == pytest.approx(0.8, abs=1e-12)
    assert transfer_spearman(predicted, {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}) == pytest.approx(-1.0, abs=1e-12)
    assert transfer_spearman(predicted, {"a": 5.0, "b": 6.0, "c": 7.0, "d": 8.0}) == pytest.approx(1.0, abs=1e-12)
    # only the mixtures both sides name count (a diverged run has no observed loss)
    assert transfer_spearman(predicted, {"a": 1.0, "c": 2.0, "d": 3.0}) == pytest.approx(1.0, abs=1e-12)
    assert transfer_spearman(predicted, {"a": 1.0, "b": 2.0}) is None
    assert transfer_spearman(predicted, dict.fromkeys(predicted, 2.0)) is None


def test_transfer_mixtures_are_the_predicted_best_worst_reference_and_evenly_spaced_between():
    predicted = {name: float(i) for i, name in enumerate("abcdefg")}  # a is predicted best
    assert choose_transfer_mixtures(predicted, ["d"], 4) == ["a", "d", "e", "g"]
    assert choose_transfer_mixtures(predicted, ["d"], 5) == ["a", "b", "d", "f", "g"]
    assert choose_transfer_mixtures(predicted, ["zz"], 3) == ["a", "d", "g"]  # not predicted: left out
    assert choose_transfer_mixtures(predicted, ["d"], 3) == ["a", "d", "g"]
    # the plan's mixture and the reference come first, then the best and the worst
    assert choose_transfer_mixtures(predicted, ["c", "e"], 4) == ["a", "c", "e", "g"]
    assert choose_transfer_mixtures(predicted, ["c", "e"], 3) == ["a", "c", "e"]
    assert choose_transfer_mixtures(predicted, ["d"], 7) == list("abcdefg")
    assert choose_transfer_mixtures(predicted, ["d"], 9) == list("abcdefg")


def test_the_transfer_check_fails_the_gate_only_below_a_configured_floor():
    transfer = {"predicted": {"a": 1.0}, "observed": {"a": 1.0}, "spearman": 0.2}
    report = check_gate(3.0, CURVE, None, mixture_transfer=transfer)
    assert report.passed and report.checks["mixture_transfer_spearman"] == 0.2
    floor = ValidateConfig(mixture_transfer=MixtureTransferConfig(min_spearman=0.5))
    failed = check_gate(3.0, CURVE, None, mixture_transfer=transfer, cfg=floor)
    assert not failed.passed and failed.reasons == [
        "the mixture regression's ranking does not transfer to the validate size: rank correlation 0.20 between "
        "predicted and observed losses (validate.mixture_transfer.min_spearman=0.5); the plan's mixture is chosen "
        "from a ranking that does not hold here"]
    assert check_gate(3.0, CURVE, None, mixture_transfer={**transfer, "spearman": 0.6}, cfg=floor).passed
    nothing = {"predicted": {}, "observed": {}, "spearman": None, "note": "nothing to rank (no trials)"}
    assert not check_gate(3.0, CURVE, None, mixture_transfer=nothing, cfg=floor).passed
    assert "mixture transfer: nothing to rank (no trials)" in check_gate(
        3.0, CURVE, None, mixture_transfer=nothing).describe()


def test_a_rank_correlation_needs_three_mixtures():
    with pytest.raises(ValidationError, match="at least 3 mixtures"):
        MixtureTransferConfig(num_mixtures=2)
    assert MixtureTransferConfig(num_mixtures=0).num_mixtures == 0


def test_the_interval_is_checked_on_the_run_on_the_laws_mixture_when_given():
    predicted = {"loss": 6.3, "low": 6.2, "high": 6.4, "level": 0.95, "num_params": 28_092, "tokens": 118_784}
    # the validate run trained a better mixture than the law's: below the interval, but the reference's run is inside
    assert not check_gate(6.17, CURVE, predicted).passed
    report = check_gate(6.17, CURVE, predicted, law_run=("transfer/uniform", 6.25))
    assert report.passed and report.checks["law_run"] == "transfer/uniform" and report.checks["inside_interval"]
    failed = check_gate(6.3, CURVE, predicted, law_run=("transfer/uniform", 6.45))
    assert failed.reasons[0].startswith("observed loss 6.4500 (transfer/uniform) is above the 95% prediction "
                                        "interval [6.2000, 6.4000]")


def test_unknown_capability_tasks_stop_the_validate_stage_before_it_trains(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"work_dir={tmp_path / 'work'}", "validate.run.steps=4", "validate.run.eval_batches=1",
        "validate.capabilities.tasks=[kiln_heldout, kiln_heldout_nope]",
        f"evaluate.eval_files=[{REPO / 'data/evals/heldout.jsonl'}, {REPO / 'data/evals/heldout_code.jsonl'}]"])
    store = commit_validate_inputs(Store(tmp_path / "store"), cfg.sweep.reference)
    # the names evaluate_lm computes for the capabilities' suite (local tasks only)
    suite = ["kiln_heldout", "kiln_heldout_choice", "kiln_heldout_code", "kiln_heldout_code_choice",
             "kiln_heldout_code_lines"]
    with pytest.raises(ConfigError) as raised:
        run_stage("validate", cfg, store=store, keys=KEYS)
    assert str(raised.value) == (
        f"eval tasks ['kiln_heldout_nope'] are not in the configured suite {suite}: name tasks of "
        "evaluate.eval_files / evaluate.standard_suite (e.g. validate.capabilities.tasks)")
    # nothing trained: the stage's partial folder holds only the failure's record (no model, checkpoints or
    # metrics) and is not committed
    assert [p.name for p in store.partial_path("validate", KEYS["validate"]).iterdir()] == [FAILURE_FILE]
    assert not store.is_complete("validate", KEYS["validate"])
