"""The evaluate report: every task's scores for every evaluated model, a table per category.

A row is one score of one task (bits per byte, accuracy, ...); columns give the task's version,
its contamination rate, the number of items scored, each model's score and each later model's
change against the baseline (the trained model, so `anneal − train` is what annealing did; an
ablation branch gets its own column and change). Written as Markdown (the stage publishes it as a
Prefect artifact) and as JSON in MLflow's table format (`mlflow.load_table` reads it).

Each row also says where the task sits (`category`, `level`), the baseline's main score with its
bootstrap 95% interval (`score`, `ci_low`, `ci_high`), its score on the items not found in the training
data (`clean_score`; generated tasks are exempt) and whether it can be trusted (`snr`, `trusted`, and the
reasons when not: `tasks.evals.trust`). A grouped task (a language, a passkey length, a position bucket)
adds a row per group under its main metric.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPORT_FILE = "report.md"
TABLE_FILE = "eval_table.json"
MLFLOW_TABLE_TAG = "mlflow.loggedArtifacts"  # how MLflow's UI finds a run's tables (as `log_table` sets it)
# Redundant with bits_per_byte: the same log-likelihood, normalised differently.
_SKIPPED_METRICS = ("word_perplexity", "byte_perplexity")


def _scores(task_results: Mapping[str, Any]) -> dict[str, float]:
    scores = {}
    for key, value in task_results.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, filter_name = key.split(",", 1)
        if metric.endswith("_stderr") or metric in _SKIPPED_METRICS:
            continue
        scores[metric if filter_name == "none" else f"{metric}_{filter_name}"] = float(value)
    return scores


def report_rows(results: Mapping[str, Mapping[str, Any]], baseline: str,
                trust: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (task, score) over every model's `results.json`; `baseline` is the model others are
    compared to; `trust`: each task's verdict (`trust.Verdict.to_json`)."""
    assert baseline in results, f"the baseline {baseline!r} has no results"
    info = results[baseline].get("kiln_tasks", {})
    items = {name: r.get("kiln_item_scores", {}) for name, r in results.items()}
    later = [name for name in results if name != baseline]
    tasks = list(dict.fromkeys(task for r in results.values() for task in r["results"]))
    rows = []
    for task in tasks:
        per_model = {name: _scores(r["results"].get(task, {})) for name, r in results.items()}
        any_results = next(r for r in results.values() if task in r["results"])
        higher = any_results.get("higher_is_better", {}).get(task, {})
        versions = sorted({str(r["versions"][task]) for r in results.values() if task in r.get("versions", {})})
        rates = sorted({r["contamination_rates"][task] for r in results.values()
                        if task in r.get("contamination_rates", {})})
        counts = sorted({r["n-samples"][task]["effective"] for r in results.values() if task in r.get("n-samples", {})})
        for metric in dict.fromkeys(m for scores in per_model.values() for m in scores):
            row: dict[str, Any] = {
                "task": task, "metric": metric, "higher_is_better": higher.get(metric),
                "version": " / ".join(versions) or None,
                "contamination_rate": rates[0] if len(rates) == 1 else None,
                "num_items": counts[0] if len(counts) == 1 else None,
            }
            base = per_model[baseline].get(metric)
            row[baseline] = base
            for name in later:
                value = per_model[name].get(metric)
                row[name] = value
                row[f"{name} - {baseline}"] = value - base if value is not None and base is not None else None
            main = items[baseline].get(task, {})
            _add_details(row, info.get(task, {}), main if main.get("metric") == metric else {},
                         (trust or {}).get(task))
            rows.append(row)
            for group in main.get("groups", {}) if main.get("metric") == metric else ():
                grouped = dict(row, task=f"{task}[{group}]")
                for name in results:
                    g = items[name].get(task, {}).get("groups", {}).get(group)
                    grouped[name] = g["score"] if g else None
                    if name != baseline:
                        base_g = grouped[baseline]
                        grouped[f"{name} - {baseline}"] = (grouped[name] - base_g if grouped[name] is not None
                                                           and base_g is not None else None)
                _add_details(grouped, info.get(task, {}), main["groups"][group], (trust or {}).get(task))
                grouped["num_items"] = main["groups"][group]["num_items"]
                grouped["decision_accuracy"] = None  # measured on the task's whole score, not a group's
                rows.append(grouped)
    return rows


def _add_details(row: dict[str, Any], info: Mapping[str, Any], main: Mapping[str, Any],
                 verdict: Mapping[str, Any] | None) -> None:
    """Where the task sits, the main score's interval and clean score, and the task's trust verdict."""
    row["category"] = info.get("category", "general")
    row["level"] = info.get("level")
    row["score"] = main.get("score")
    row["ci_low"], row["ci_high"] = main.get("ci_low"), main.get("ci_high")
    row["clean_score"] = main.get("clean_score")
    row["exempt"] = info.get("exempt", False)
    snr = None if verdict is None else verdict.get("snr")
    row["snr"] = snr if snr is None or math.isfinite(snr) else None  # no noise at all: JSON has no infinity
    # Of the main metric only: the one whose ranking the decision accuracy measured.
    row["decision_accuracy"] = None if verdict is None or not main else verdict.get("decision_accuracy")
    row["trusted"] = None if verdict is None else verdict["trusted"]
    row["trust_reasons"] = None if verdict is None else "; ".join(verdict["reasons"]) or None


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _change(value: float | None, higher_is_better: bool | None) -> str:
    if value is None:
        return "–"
    if higher_is_better is None or value == 0:
        return f"{value:+.4f}"
    return f"{value:+.4f} ({'better' if (value > 0) == higher_is_better else 'worse'})"


def report_markdown(rows: Sequence[Mapping[str, Any]], models: Sequence[str], baseline: str,
                    skipped: Mapping[str, str] | None = None, decision_note: str | None = None) -> str:
    later = [m for m in models if m != baseline]
    header = ["task", "level", "metric", "version", "contamination", "items", baseline, "95% CI", "clean", "SNR", "trusted"]
    for name in later:
        header += [name, f"{name} − {baseline}"]
    lines = [
        "# Evaluation",
        "",
        f"Scores of each model on each task, a table per category. `{baseline}` is the baseline; `X − {baseline}` is "
        f"the change model X makes (annealing, for `anneal`; a short anneal on candidate mixture NAME, for `ablation/NAME`). "
        "↑: higher is better, ↓: lower is better. Level: proxy (bits per byte of the gold text), mid (multiple "
        "choice), production (generated or executed). Contamination: the share of the task's scored items drawn "
        "from eval documents that share an n-gram with the training data; clean: the score on the other items "
        "(exempt: generated items, never in any training data). 95% CI: bootstrap over the items. Trusted: the "
        "task's SNR, monotonicity over training and margin above random meet its level's thresholds "
        "(evaluate.trust); an untrusted task stays here and says why below its table.",
    ]
    for category in dict.fromkeys(row.get("category", "general") for row in rows):
        chosen = [row for row in rows if row.get("category", "general") == category]
        lines += ["", f"## {category}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] * 4 + ["---:"] * (len(header) - 4)) + "|"]
        for row in chosen:
            arrow = {True: " ↑", False: " ↓"}.get(row["higher_is_better"], "")
            rate = row["contamination_rate"]
            interval = "–" if row.get("ci_low") is None else f"{row['ci_low']:.3f}–{row['ci_high']:.3f}"
            clean = "exempt" if row.get("exempt") else _cell(row.get("clean_score"))
            trusted = {True: "yes", False: "no", None: "–"}[row.get("trusted")]
            cells = [row["task"], row.get("level") or "–", f"{row['metric']}{arrow}", row["version"] or "–",
                     "–" if rate is None else f"{rate:.1%}", _cell(row["num_items"]), _cell(row[baseline]),
                     interval, clean, _cell(row.get("snr"), 2), trusted]
            for name in later:
                cells += [_cell(row[name]), _change(row[f"{name} - {baseline}"], row["higher_is_better"])]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        reasons = dict.fromkeys((row["task"].split("[")[0], row["trust_reasons"]) for row in chosen
                                if row.get("trust_reasons"))
        if reasons:
            lines += ["", "Not trusted:", ""] + [f"- `{task}`: {why}" for task, why in reasons]
    decided = dict.fromkeys((row["task"].split("[")[0], row["metric"], row["decision_accuracy"]) for row in rows
                            if row.get("decision_accuracy") is not None and "[" not in row["task"])
    if decision_note and decided:
        lines += ["", "## Decision accuracy", "", decision_note, "", "| task | metric | decision accuracy |",
                  "|---|---|---:|"] + [f"| {task} | {metric} | {value:.2f} |" for task, metric, value in decided]
    if skipped:
        lines += ["", "Tasks not built:", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, results: Mapping[str, Mapping[str, Any]], baseline: str,
                 trust: Mapping[str, Mapping[str, Any]] | None = None, decision_note: str | None = None
                 ) -> list[dict[str, Any]]:
    """Write `report.md` and `eval_table.json` (MLflow's split-orient table) into `out_dir`; returns the rows.
    `decision_note` says where the tasks' decision accuracies (in `trust`) come from; with it, the report
    has a table of them."""
    rows = report_rows(results, baseline, trust)
    skipped = {name: reason for r in results.values() for name, reason in r.get("kiln_skipped_tasks", {}).items()}
    (out_dir / REPORT_FILE).write_text(report_markdown(rows, list(results), baseline, skipped, decision_note),
                                       encoding="utf-8")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = {"columns": columns, "data": [[row.get(c) for c in columns] for row in rows]}
    (out_dir / TABLE_FILE).write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return rows


def mlflow_table_tag() -> dict[str, str]:
    """The run tag that makes MLflow's UI list `eval_table.json` as a table (what `MlflowClient.log_table` sets)."""
    return {MLFLOW_TABLE_TAG: json.dumps([{"path": TABLE_FILE, "type": "table"}])}
