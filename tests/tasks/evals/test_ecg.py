"""The ECG: each task's main score by step, regressions judged against each score's noise (one event
where a regression starts, one where it clears), and the plot."""

from __future__ import annotations

import math

import pytest

from kiln.tasks.evals.ecg import (
    Curve,
    RegressionEvent,
    Score,
    all_events,
    curves,
    noise,
    open_regressions,
    plot_ecg,
    trusted_events,
)


def rows(task: str, values: dict[int, dict[str, float]]) -> dict[tuple[int, str], dict]:
    return {(step, task): {"step": step, "task": task, "version": "1", "metrics": {f"{task}/{k}": v for k, v in m.items()}}
            for step, m in values.items()}


def choice(acc_norm: float, n: int = 10) -> dict[str, float]:
    """A multiple-choice task's row as lm-eval reports it: the share right, its standard error, the items."""
    return {"acc": acc_norm, "acc_norm": acc_norm, "acc_norm_stderr": math.sqrt(acc_norm * (1 - acc_norm) / (n - 1)),
            "num_docs": n}


def events_of(task_rows: dict, sigmas: float = 2.0, min_change: float = 0.05) -> list[tuple[str, int, int]]:
    return [(e.kind, e.step, e.since) for e in all_events(curves(task_rows), sigmas, min_change)]


def test_curves_follow_each_tasks_main_score_with_its_noise():
    series = curves({**rows("kiln_heldout", {10: {"bits_per_byte": 3.0, "word_perplexity": 90.0, "num_docs": 10},
                                             20: {"bits_per_byte": 2.5, "num_docs": 10}}),
                     **rows("kiln_heldout_choice", {10: choice(0.3)})})
    assert series["kiln_heldout"] == Curve("kiln_heldout", "bits_per_byte", False,
                                           [Score(10, 3.0, None, 10), Score(20, 2.5, None, 10)])
    assert series["kiln_heldout"].points == [(10, 3.0), (20, 2.5)]
    assert series["kiln_heldout_choice"].metric == "acc_norm" and series["kiln_heldout_choice"].higher_is_better
    assert series["kiln_heldout_choice"].scores[0].stderr == pytest.approx(0.1528, abs=1e-4)


def test_a_ten_item_tasks_one_item_wobble_is_noise_not_a_regression():
    # the first healthy run: acc_norm 0.3 -> 0.2 (one item of ten) against a 0.05 tolerance fired twice
    wobble = rows("kiln_heldout_choice", {100: choice(0.3), 200: choice(0.2), 300: choice(0.3), 400: choice(0.2),
                                          500: choice(0.1)})
    assert events_of(wobble) == []
    curve = curves(wobble)["kiln_heldout_choice"]
    # two standard errors of the difference of 0.3 and 0.2 on ten items: 0.41, four items
    assert noise("acc_norm", curve.scores[0], curve.scores[1], 2.0, 0.05) == pytest.approx(0.406, abs=1e-3)
    # a collapse is not noise, even on ten items: 0.8 -> 0.1
    assert events_of(rows("t", {100: choice(0.8), 200: choice(0.1)})) == [("started", 200, 200)]


def test_a_score_of_zero_or_one_still_has_noise():
    # lm-eval reports a standard error of 0 for 0/10 and 10/10: no difference would then be noise
    curve = curves(rows("kiln_code_lines", {1: {"exact_match": 0.1, "exact_match_stderr": 0.1, "num_docs": 10},
                                            2: {"exact_match": 0.0, "exact_match_stderr": 0.0, "num_docs": 10}}))
    best, current = curve["kiln_code_lines"].scores
    assert noise("exact_match", best, current, 2.0, 0.05) > 0.1
    assert events_of(rows("l", {1: {"exact_match": 0.1, "exact_match_stderr": 0.1, "num_docs": 10},
                                2: {"exact_match": 0.0, "exact_match_stderr": 0.0, "num_docs": 10}})) == []
    # on a thousand items the same share is a real move: 2 x 0.0095 = 0.019 < 0.1
    big = rows("l", {1: {"exact_match": 0.1, "num_docs": 1000}, 2: {"exact_match": 0.0, "num_docs": 1000}})
    assert events_of(big) == [("started", 2, 2)]


def test_a_sustained_rise_in_bits_per_byte_is_one_regression_and_one_clearing():
    # the overfitting run: code bits per byte 3.06 at its best, then rising to 3.61
    code = rows("kiln_heldout_code", {step: {"bits_per_byte": v, "num_docs": 10} for step, v in
                                      {300: 3.40, 600: 3.06, 900: 3.10, 1200: 3.25, 1500: 3.42, 1800: 3.61}.items()})
    # 3.10 is within 5 % of 3.06 (noise); 3.25 is not: it starts there and stays open, one event
    assert events_of(code) == [("started", 1200, 1200)]
    [event] = all_events(curves(code), 2.0, 0.05)
    assert (event.event, event.best, event.best_step, event.current) == ("kiln.eval.regression", 3.06, 600, 3.25)
    assert event.noise == pytest.approx(0.05 * 3.06)
    assert open_regressions([event]) == [event]
    # a fall back to within the noise of the best clears it, once; a later rise starts a new one
    recovered = {**code, **rows("kiln_heldout_code", {2100: {"bits_per_byte": 3.12, "num_docs": 10},
                                                      2400: {"bits_per_byte": 3.08, "num_docs": 10},
                                                      2700: {"bits_per_byte": 3.5, "num_docs": 10}})}
    assert events_of(recovered) == [("started", 1200, 1200), ("cleared", 2100, 1200), ("started", 2700, 2700)]
    cleared = all_events(curves(recovered), 2.0, 0.05)[1]
    assert cleared.payload() == {"kind": "cleared", "task": "kiln_heldout_code", "metric": "bits_per_byte", "step": 2100,
                                 "current": 3.12, "best": 3.06, "best_step": 600, "noise": cleared.noise, "since": 1200}
    assert cleared.event == "kiln.eval.regression.cleared"
    assert [e.step for e in open_regressions(all_events(curves(recovered), 2.0, 0.05))] == [2700]
    # a coarser minimum change: only 3.61 (> 1.15 x 3.06) is a regression, and 3.12 clears it
    assert events_of(recovered, min_change=0.15) == [("started", 1800, 1800), ("cleared", 2100, 1800)]
    assert all_events(curves(recovered), None, 0.05) == []  # regression_sigmas: null turns it off


def test_a_task_judged_not_trusted_raises_no_regression_alert_and_is_named():
    # The same rise on two tasks: one the evaluate stage trusts, one it does not, one it has not judged.
    rise = {300: 3.40, 600: 3.06, 900: 3.10, 1200: 3.25}
    series = curves({**rows("kiln_heldout_code", {s: {"bits_per_byte": v, "num_docs": 10} for s, v in rise.items()}),
                     **rows("kiln_position", {s: {"bits_per_byte": v, "num_docs": 10} for s, v in rise.items()}),
                     **rows("kiln_new", {s: {"bits_per_byte": v, "num_docs": 10} for s, v in rise.items()})})
    events = all_events(series, 2.0, 0.05)
    assert [e.task for e in events] == ["kiln_heldout_code", "kiln_new", "kiln_position"]
    kept, left_out = trusted_events(events, {"kiln_heldout_code": True, "kiln_position": False})
    assert [e.task for e in kept] == ["kiln_heldout_code", "kiln_new"] and left_out == ["kiln_position"]
    assert open_regressions(kept) == kept
    # Before the evaluate stage has judged anything, every task alerts.
    assert trusted_events(events, {}) == (events, [])


def test_the_plot_has_a_panel_per_task_and_the_anneal_curve_after_trainings(tmp_path):
    series = curves({**rows("kiln_heldout", {10: {"bits_per_byte": 3.0}, 20: {"bits_per_byte": 2.5},
                                             30: {"bits_per_byte": 2.9}, 40: {"bits_per_byte": 2.55}}),
                     **rows("kiln_heldout_choice", {10: choice(0.3), 20: choice(0.4)})})
    anneal = {"kiln_heldout": Curve("kiln_heldout", "bits_per_byte", False, [Score(5, 2.4), Score(10, 2.3)])}
    events = [("train", e) for e in all_events(series, 2.0, 0.05)]
    assert [(e.kind, e.step) for _, e in events] == [("started", 30), ("cleared", 40)]
    path = plot_ecg({"train": series, "anneal": anneal}, {"anneal": 40}, tmp_path / "ecg" / "ecg.png",
                    events + [("anneal", RegressionEvent("started", "kiln_heldout", "bits_per_byte", 10, 2.3, 2.2, 5,
                                                         0.1, 10))])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert sorted(p.name for p in path.parent.iterdir()) == ["ecg.json", "ecg.png"]  # written whole, then renamed; its data beside it
