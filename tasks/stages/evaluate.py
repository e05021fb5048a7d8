"""Stage `evaluate`: lm-eval on the trained and the annealed model, with task versions, contamination
rates and the report table (what annealing changed, task by task), with a column per anneal-ablation
branch (scored by the anneal-ablation stage with this same suite, read from its output)."""

from __future__ import annotations

import json

from kiln.tasks.constants import TOKENIZER_FILE
from kiln.tasks.data.decontaminate import read_contamination
from kiln.tasks.evals.evaluate import RESULTS_FILE, EvaluateConfig, evaluate_model
from kiln.tasks.evals.report import REPORT_FILE, mlflow_table_tag, write_report
from kiln.tasks.evals.suite import primary_metric
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import eval_file_paths, suite_eval_files
from kiln.tasks.stages.anneal_ablation import ablation_results

BASELINE = "train"  # the report's changes are each model's score minus the trained model's


def run(ctx: StageContext) -> dict:

    eval_file_paths(ctx.cfg)
    tokenizer = ctx.inputs["tokenize"] / TOKENIZER_FILE
    contamination = read_contamination(ctx.inputs["decontaminate"])
    metrics, results = {}, {}
    for name in (BASELINE, "anneal"):
        out = ctx.out_dir / name
        out.mkdir()
        metrics[name] = evaluate_model(ctx.cfg.evaluate, ctx.inputs[name] / "model", tokenizer, out,
                                       contamination=contamination)
        results[name] = json.loads((out / RESULTS_FILE).read_text(encoding="utf-8"))
    for name, branch in ablation_results(ctx.inputs["anneal-ablation"]).items():
        metrics[name] = branch["metrics"]
        results[name] = branch["results"]
    rows = write_report(ctx.out_dir, results, BASELINE)
    versions = {task: str(version) for task, version in results[BASELINE]["versions"].items()}
    ctx.recorder.tracker.set_tags(ctx.recorder.run_id, {**mlflow_table_tag(),
                                                       **{f"kiln.task_version.{t}": v for t, v in versions.items()}})
    tasks = {task: {"version": version, "contamination_rate": results[BASELINE].get("contamination_rates", {}).get(task),
                    "primary_metric": primary_metric([r["metric"] for r in rows if r["task"] == task])}
             for task, version in versions.items()}
    return {"metrics": metrics, "tasks": tasks}


def headline(stats: dict) -> dict:
    """Each task's main score for each model (bits per byte, normalised accuracy, exact match)."""
    out = {}
    for task, info in stats.get("tasks", {}).items():
        metric = info["primary_metric"]
        for model, metrics in stats["metrics"].items():
            if metric and f"{task}/{metric}" in metrics:
                out[f"{model}/{task}/{metric}"] = round(metrics[f"{task}/{metric}"], 4)
    return out


# version 3: a column per anneal-ablation branch
STAGE = Stage(
    name="evaluate", description="lm-eval on held-out tasks: perplexity, multiple choice, code lines", body=run,
    inputs=("anneal", "anneal-ablation", "train", "tokenize", "decontaminate"), config=EvaluateConfig,
    external_files=suite_eval_files, headline=headline, reports=(REPORT_FILE,), version=3,
)
