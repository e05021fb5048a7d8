"""The ECG: each task's main score by step, regressions against the best so far, and the plot."""

from __future__ import annotations

from tasks.evals.ecg import Curve, curves, find_regressions, plot_ecg


def rows(task: str, values: dict[int, dict[str, float]]) -> dict[tuple[int, str], dict]:
    return {(step, task): {"step": step, "task": task, "version": "1", "metrics": {f"{task}/{k}": v for k, v in m.items()}}
            for step, m in values.items()}


ROWS = {
    **rows("kiln_heldout", {10: {"bits_per_byte": 3.0, "word_perplexity": 90.0}, 20: {"bits_per_byte": 2.5},
                            30: {"bits_per_byte": 2.6}, 40: {"bits_per_byte": 2.7}}),
    **rows("kiln_heldout_choice", {10: {"acc": 0.3, "acc_norm": 0.30}, 20: {"acc": 0.2, "acc_norm": 0.40},
                                   30: {"acc": 0.5, "acc_norm": 0.33}}),
}


def test_curves_follow_each_tasks_main_score():
    series = curves(ROWS)
    assert series["kiln_heldout"] == Curve("kiln_heldout", "bits_per_byte", False, [(10, 3.0), (20, 2.5), (30, 2.6), (40, 2.7)])
    assert series["kiln_heldout_choice"].metric == "acc_norm" and series["kiln_heldout_choice"].higher_is_better


def test_a_new_score_worse_than_the_best_before_it_by_more_than_the_tolerance_is_a_regression():
    series = curves(ROWS)
    new = {(30, "kiln_heldout"), (40, "kiln_heldout"), (30, "kiln_heldout_choice")}
    found = find_regressions(series, new, tolerance=0.05)
    assert [(r.task, r.step, r.best, r.best_step, r.current) for r in found] == [
        ("kiln_heldout", 30, 2.5, 20, 2.6),  # bits per byte: lower is better
        ("kiln_heldout_choice", 30, 0.40, 20, 0.33),  # accuracy: higher is better
        ("kiln_heldout", 40, 2.5, 20, 2.7),
    ]
    assert found[0].payload() == {"task": "kiln_heldout", "metric": "bits_per_byte", "step": 30, "best": 2.5,
                                  "best_step": 20, "current": 2.6, "tolerance": 0.05}
    assert [(r.task, r.step) for r in find_regressions(series, new, tolerance=0.15)] == [("kiln_heldout", 40)]
    # Only new scores are judged: the same regression is not raised again by the next run.
    assert find_regressions(series, {(20, "kiln_heldout")}, tolerance=0.0) == []


def test_the_plot_has_a_panel_per_task_and_the_anneal_curve_after_trainings(tmp_path):
    series = curves(ROWS)
    anneal = {"kiln_heldout": Curve("kiln_heldout", "bits_per_byte", False, [(5, 2.4), (10, 2.3)])}
    path = plot_ecg({"train": series, "anneal": anneal}, {"anneal": 40}, tmp_path / "ecg" / "ecg.png",
                    {("train", "kiln_heldout", 30)})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in path.parent.iterdir()] == ["ecg.png"]  # written whole, then renamed
