"""The evaluate report: one row per task score, each model's value, the change against the trained model."""

from __future__ import annotations

import json

import pytest

from kiln.tasks.evals.report import REPORT_FILE, TABLE_FILE, mlflow_table_tag, write_report


def results(bpb: float, acc: float, acc_norm: float, *, skipped: dict | None = None) -> dict:
    """The parts of an evaluate `results.json` the report reads."""
    return {
        "results": {"kiln_heldout": {"alias": "kiln_heldout", "bits_per_byte,none": bpb, "bits_per_byte_stderr,none": "N/A",
                                     "word_perplexity,none": 9.0, "byte_perplexity,none": 2.0},
                    "kiln_heldout_choice": {"acc,none": acc, "acc_stderr,none": 0.1, "acc_norm,none": acc_norm}},
        "higher_is_better": {"kiln_heldout": {"bits_per_byte": False, "word_perplexity": False},
                             "kiln_heldout_choice": {"acc": True, "acc_norm": True}},
        "versions": {"kiln_heldout": "1+aaaa", "kiln_heldout_choice": "1+bbbb"},
        "n-samples": {"kiln_heldout": {"original": 63, "effective": 10}, "kiln_heldout_choice": {"original": 126, "effective": 10}},
        "contamination_rates": {"kiln_heldout": 0.1, "kiln_heldout_choice": 0.05},
        "kiln_skipped_tasks": skipped or {},
    }


def test_one_row_per_task_score_with_version_contamination_and_the_change_annealing_made(tmp_path):
    rows = write_report(tmp_path, {"train": results(2.5, 0.4, 0.5),
                                   "anneal": results(2.25, 0.5, 0.25, skipped={"kiln_code_lines": "no line"}),
                                   "ablation/web": results(2.75, 0.4, 0.5)}, baseline="train")
    assert [(r["task"], r["metric"]) for r in rows] == [
        ("kiln_heldout", "bits_per_byte"), ("kiln_heldout_choice", "acc"), ("kiln_heldout_choice", "acc_norm")]
    bpb = rows[0]
    assert (bpb["version"], bpb["contamination_rate"], bpb["num_items"], bpb["higher_is_better"]) == ("1+aaaa", 0.1, 10, False)
    assert (bpb["train"], bpb["anneal"], bpb["anneal - train"], bpb["ablation/web - train"]) == (2.5, 2.25, -0.25, 0.25)
    assert rows[2]["anneal - train"] == -0.25

    markdown = (tmp_path / REPORT_FILE).read_text()
    assert ("| task | level | metric | version | contamination | items | train | 95% CI | clean | SNR | trusted "
            "| anneal | anneal − train | ablation/web |") in markdown
    assert "| kiln_heldout | – | bits_per_byte ↓ | 1+aaaa | 10.0% | 10 | 2.5000 | – | – | – | – | 2.2500 | -0.2500 (better) " in markdown
    assert "| kiln_heldout_choice | – | acc_norm ↑ | 1+bbbb | 5.0% | 10 | 0.5000 | – | – | – | – | 0.2500 | -0.2500 (worse) " in markdown
    assert "- `kiln_code_lines`: no line" in markdown and "## general" in markdown
    # an ablation branch is a model of its own, with its change against the trained model
    assert "| ablation/web | ablation/web − train |" in markdown and "| 2.7500 | +0.2500 (worse) |" in markdown

    table = json.loads((tmp_path / TABLE_FILE).read_text())  # MLflow's table format (pandas split orient)
    assert table["columns"][:3] == ["task", "metric", "higher_is_better"]
    assert {"category", "level", "score", "ci_low", "ci_high", "snr", "trusted", "contamination_rate",
            "clean_score"} <= set(table["columns"])
    assert len(table["data"]) == 3 and table["data"][0][table["columns"].index("anneal - train")] == -0.25
    assert json.loads(mlflow_table_tag()["mlflow.loggedArtifacts"]) == [{"path": TABLE_FILE, "type": "table"}]


def test_the_table_loads_as_mlflow_loads_a_logged_table(tmp_path):
    pandas = pytest.importorskip("pandas")
    write_report(tmp_path, {"train": results(2.5, 0.4, 0.5), "anneal": results(2.25, 0.5, 0.25)}, baseline="train")
    frame = pandas.read_json(tmp_path / TABLE_FILE, orient="split")  # what mlflow.load_table does with it
    assert list(frame["task"]) == ["kiln_heldout", "kiln_heldout_choice", "kiln_heldout_choice"]
    assert frame["anneal - train"].tolist() == pytest.approx([-0.25, 0.1, -0.25])


def test_grouped_rows_intervals_clean_scores_and_trust_per_category(tmp_path):
    train = results(2.5, 0.4, 0.5)
    train["results"]["kiln_multilingual"] = {"bits_per_byte,none": 3.0}
    train["higher_is_better"]["kiln_multilingual"] = {"bits_per_byte": False}
    train["versions"]["kiln_multilingual"] = "1+cccc"
    train["kiln_tasks"] = {"kiln_heldout": {"category": "general", "level": "proxy"},
                           "kiln_heldout_choice": {"category": "general", "level": "mid"},
                           "kiln_multilingual": {"category": "multilingual", "level": "proxy"}}
    group = {"score": 2.9, "ci_low": 2.5, "ci_high": 3.3, "num_items": 4, "clean_score": 2.9}
    train["kiln_item_scores"] = {
        "kiln_heldout_choice": {"metric": "acc_norm", "score": 0.5, "ci_low": 0.2, "ci_high": 0.8, "clean_score": 0.6},
        "kiln_multilingual": {"metric": "bits_per_byte", "score": 3.0, "ci_low": 2.8, "ci_high": 3.2, "clean_score": 3.0,
                              "groups": {"de": group, "ja": {**group, "score": 3.1}}}}
    trust = {"kiln_heldout_choice": {"trusted": False, "reasons": ["SNR 0.50 < 2.0"], "snr": 0.5},
             "kiln_multilingual": {"trusted": True, "reasons": [], "snr": 12.0, "decision_accuracy": 2 / 3}}
    rows = write_report(tmp_path, {"train": train}, baseline="train", trust=trust,
                        decision_note="Decision accuracy: from 3 mixtures at two sizes.")
    by = {(r["task"], r["metric"]): r for r in rows}
    choice = by[("kiln_heldout_choice", "acc_norm")]
    assert (choice["category"], choice["level"], choice["score"], choice["ci_low"], choice["ci_high"],
            choice["clean_score"], choice["snr"], choice["trusted"]) == ("general", "mid", 0.5, 0.2, 0.8, 0.6, 0.5, False)
    assert by[("kiln_heldout_choice", "acc")]["score"] is None  # the interval is the main metric's
    assert by[("kiln_multilingual[ja]", "bits_per_byte")]["train"] == 3.1
    assert by[("kiln_multilingual[de]", "bits_per_byte")]["num_items"] == 4
    markdown = (tmp_path / REPORT_FILE).read_text()
    assert markdown.index("## general") < markdown.index("## multilingual")
    assert "- `kiln_heldout_choice`: SNR 0.50 < 2.0" in markdown
    assert "| kiln_multilingual[de] | proxy | bits_per_byte ↓ | 1+cccc | – | 4 | 2.9000 | 2.500–3.300 | 2.9000 | 12.00 | yes |" in markdown
    # The decision accuracy: a column of the table, and a table of its own (one row per task, not per group).
    assert by[("kiln_multilingual", "bits_per_byte")]["decision_accuracy"] == pytest.approx(2 / 3)
    assert by[("kiln_heldout_choice", "acc_norm")]["decision_accuracy"] is None
    trust["kiln_heldout_choice"]["decision_accuracy"] = 0.5  # the main metric's row only, not acc's
    rows = write_report(tmp_path, {"train": train}, baseline="train", trust=trust, decision_note="From 3 mixtures.")
    assert [(r["task"], r["metric"]) for r in rows if r["decision_accuracy"] is not None] == [
        ("kiln_heldout_choice", "acc_norm"), ("kiln_multilingual", "bits_per_byte")]
    assert markdown.split("## Decision accuracy\n\n")[1].startswith(
        "Decision accuracy: from 3 mixtures at two sizes.\n\n| task | metric | decision accuracy |\n|---|---|---:|\n"
        "| kiln_multilingual | bits_per_byte | 0.67 |\n")
