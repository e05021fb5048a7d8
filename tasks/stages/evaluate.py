"""Stage `evaluate`: lm-eval on the trained and the annealed model, with task versions, contamination
rates and the report table (what annealing changed, task by task), with a column per anneal-ablation
branch (scored by the anneal-ablation stage with this same suite, read from its output).

Each task's trust (`tasks.evals.trust`) is measured on the run's own models: its score over the train
stage's kept checkpoints (scored at the continuous-eval levels and item limit, through continuous eval's
state, so its end-of-run pass does not score them again), then the final trained and annealed models.
The signal is the spread over the models this stage scores: trained, annealed and each anneal-ablation
mixture (the sweep's proxies are not scored by the suite here); the noise the largest of the spread over
the last checkpoints and the standard error over the items (the bootstrap interval's half-width / 1.96)."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.continuous_state import anneal_offset
from kiln.tasks.data.decontaminate import read_contamination
from kiln.tasks.evals.evaluate import RESULTS_FILE, EvaluateConfig, evaluate_model
from kiln.tasks.evals.report import REPORT_FILE, mlflow_table_tag, write_report
from kiln.tasks.evals.continuous import current_rows, eval_target, evaluate_checkpoint, plan_evaluations, read_recorded
from kiln.tasks.evals.ecg import curves
from kiln.tasks.evals.suite import PRIMARY_METRICS, primary_metric
from kiln.tasks.evals.trust import TRUST_FILE, Verdict, task_verdicts
from kiln.tasks.stage import STATS_FILE, Stage, StageContext
from kiln.tasks.stages._common import eval_file_paths, suite_eval_files
from kiln.tasks.scaling.validate import REPORT_FILE as GATE_FILE
from kiln.tasks.stages.anneal_ablation import ablation_results
from kiln.tasks.train.checkpoint import BEFORE_PHASE_DIR

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
    decisions = (ctx.read_json("validate", GATE_FILE).get("decision_accuracy") or {})
    verdicts = trust_verdicts(ctx, tokenizer, metrics, results[BASELINE], decisions.get("by_task", {}))
    (ctx.out_dir / TRUST_FILE).write_text(json.dumps({t: v.to_json() for t, v in verdicts.items()}, indent=1,
                                                     default=str) + "\n", encoding="utf-8")
    rows = write_report(ctx.out_dir, results, BASELINE, {t: v.to_json() for t, v in verdicts.items()},
                        decision_note(decisions))
    versions = {task: str(version) for task, version in results[BASELINE]["versions"].items()}
    ctx.recorder.tracker.set_tags(ctx.recorder.run_id, {**mlflow_table_tag(),
                                                       **{f"kiln.task_version.{t}": v for t, v in versions.items()}})
    tasks = {task: {"version": version, "contamination_rate": results[BASELINE].get("contamination_rates", {}).get(task),
                    "primary_metric": primary_metric([r["metric"] for r in rows if r["task"] == task]),
                    "trusted": verdicts[task].trusted if task in verdicts else None}
             for task, version in versions.items()}
    extension = long_context_extension(ctx, tokenizer)
    return {"metrics": metrics, "tasks": tasks, **({"long_context_extension": extension} if extension else {})}


def long_context_extension(ctx: StageContext, tokenizer: Path) -> dict:
    """Loss by position past the old context and passkeys at several lengths, of the model before each of the
    train run's context-extension phases (the model it saved at the phase's start) and of the trained model
    (`tasks.evals.long_context`); nothing when its data schedule extended no context."""
    train = ctx.inputs["train"]
    phases = ctx.read_json("train", STATS_FILE).get("phases", [])
    if not (train / BEFORE_PHASE_DIR).is_dir() or not phases:
        return {}
    from kiln.tasks.evals.long_context import extension_reports, tokenizer_view  # defers torch

    view = tokenizer_view(tokenizer, max(p["seq_len"] for p in phases))
    return extension_reports(train, phases, train / BEFORE_PHASE_DIR, view, ctx.read_json("tokenize", SHARDS_FILE),
                             ctx.inputs["tokenize"])


def decision_note(decisions: dict) -> str | None:
    """Where the report's decision accuracies come from, or None when the validate stage measured none."""
    if not decisions.get("by_task"):
        return None
    return (f"Decision accuracy (DataDecide): {len(decisions['mixtures'])} mixtures ({', '.join(decisions['mixtures'])}) "
            f"trained at the sweep's size and again at the validate size (validate's mixture transfer), each scored on "
            f"the validate gate's tasks; per task, the share of the {decisions['pairs']} pairs whose order at the "
            "sweep's size holds at the validate size (1: the small runs rank the mixtures as the larger ones do; "
            "0.5: a coin). Tasks the gate does not score have none.")


def trust_verdicts(ctx: StageContext, tokenizer: Path, metrics: dict[str, dict], baseline: dict,
                   decisions: dict[str, float | None] | None = None) -> dict[str, Verdict]:
    """Score the train stage's last `evaluate.trust.last_k` kept checkpoints not yet scored by continuous eval,
    and judge every local task on its series: those checkpoints and earlier ones scored, the final
    trained model at the last train step and the annealed one after it. `decisions`: the validate stage's
    decision accuracy by "task/metric" (`GateReport.decision_accuracy`), shown beside the task's measures."""
    cfg = ctx.cfg
    target = eval_target(cfg.continuous_eval, cfg.evaluate, stage="train", key=ctx.inputs["train"].name,
                         checkpoint_every=cfg.train.run.checkpoint_every, store=ctx.store, tokenizer=tokenizer,
                         work_dir=Path(cfg.work_dir))
    plan = plan_evaluations(target)
    for step in sorted(plan.due)[-cfg.evaluate.trust.last_k:]:
        evaluate_checkpoint(target, step, plan.due[step], plan.versions)
    rows = current_rows(read_recorded(target.state_file), plan.versions)
    series: dict[str, dict[int, float]] = {task: dict(curve.points) for task, curve in curves(rows).items()}
    end = anneal_offset(cfg, target)  # the final trained model's step (the plan may set the step count)
    infos = {}
    for task, info in baseline.get("kiln_tasks", {}).items():
        item = baseline.get("kiln_item_scores", {}).get(task, {})
        metric = item.get("metric")
        if metric is None:
            continue
        points = series.setdefault(task, {})
        for model, step in ((BASELINE, end), ("anneal", end + cfg.anneal.steps)):
            value = metrics[model].get(f"{task}/{metric}")
            if value is not None:
                points[step] = value
        # Signal: the spread over the models this stage scores (trained, annealed, each anneal-ablation mixture).
        models = [m[f"{task}/{metric}"] for m in metrics.values() if f"{task}/{metric}" in m]
        stderr = (item["ci_high"] - item["ci_low"]) / (2 * 1.96) if item.get("ci_high") is not None else None
        infos[task] = {"level": info["level"], "higher_is_better": PRIMARY_METRICS[metric], "chance": item.get("chance"),
                       "score": item.get("score"), "models": models, "item_stderr": stderr,
                       "decision": (decisions or {}).get(f"{task}/{metric}")}
    return task_verdicts({t: sorted(p.items()) for t, p in series.items()}, infos, cfg.evaluate.trust)


def headline(stats: dict) -> dict:
    """Each task's main score for each model (bits per byte, normalised accuracy, exact match)."""
    out = {}
    for task, info in stats.get("tasks", {}).items():
        metric = info["primary_metric"]
        for model, metrics in stats["metrics"].items():
            if metric and f"{task}/{metric}" in metrics:
                out[f"{model}/{task}/{metric}"] = round(metrics[f"{task}/{metric}"], 4)
    for phase, report in stats.get("long_context_extension", {}).items():
        past = list(report["before"]["loss_by_position"])[1:]  # the buckets past the old context
        before, after = (sum(report[side]["loss_by_position"][k] for k in past) / len(past) for side in ("before", "after"))
        out[f"extension/{phase}/loss_past_{report['old_seq_len']}"] = f"{before:.4f} -> {after:.4f}"
    return out


# version 3: a column per anneal-ablation branch
# version 4: categories and levels, intervals, clean scores and each task's trust
# version 5: each task's decision accuracy from the validate stage's mixture runs (an input now); a limit
# samples a grouped task by group
STAGE = Stage(
    name="evaluate", description="lm-eval on the suite by category and level, with intervals, clean scores and trust", body=run,
    inputs=("anneal", "anneal-ablation", "train", "tokenize", "decontaminate", "validate"), config=EvaluateConfig,
    external_files=suite_eval_files, headline=headline, reports=(REPORT_FILE,), version=5,
    # The checkpoints' scores that measure trust are at continuous eval's item limit. Which checkpoints
    # exist (train.run.checkpoint_every, keep_every) and continuous eval's levels are runtime settings: they
    # change the trust measures' inputs, not the scores, and move no key.
    reads=("continuous_eval.limit",),
)
