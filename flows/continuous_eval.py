"""The continuous-eval flow (DESIGN's "watch" row): scores each new train and anneal checkpoint while
those stages run, draws the electrocardiogram and raises an event when a score regresses.

The `continuous-eval` deployment in infra/prefect.yaml runs it on a schedule. For each training
stage (train, anneal), each run evaluates, one Prefect task per checkpoint, the committed
checkpoints at multiples of `continuous_eval.every` on the configured tasks the state file beside
the data does not list at their current version (`tasks.evals.continuous`), then mirrors the state
file into one MLflow run per stage key, eval settings and task versions, each checkpoint's scores
at its step. When anything new was scored it:

- emits the Prefect event `kiln.eval.regression` (resource `kiln.eval.<config name>`; payload task,
  step, best, current, tolerance, ...) for each new score worse than its best so far by more than
  `continuous_eval.regression_tolerance` (`tasks.evals.ecg`);
- draws the ECG, each task's main score against the step (train, then anneal), to
  `{work_dir}/continuous_eval/{train key}/ecg.png`, logged to both MLflow runs and published with
  the table of scores as Prefect artifacts.

A run with nothing new changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.runtime import flow_run

from flows.environment import apply_run_settings
from tasks.config import KilnConfig, load_config
from tasks.data.tokenize import TOKENIZER_FILE
from tasks.evals.continuous import (
    EvalTarget,
    current_rows,
    eval_target,
    evaluate_checkpoint,
    plan_evaluations,
    read_recorded,
    recorded_steps,
    scores_table,
    suite_versions,
)
from tasks.evals.ecg import ECG_FILE, REGRESSION_EVENT, Regression, curves, find_regressions, plot_ecg
from tasks.graph import stage_keys
from tasks.store import Store
from tasks.tracking import MlflowTracker
from tasks.train.anneal import anneal_checkpointing

RUN_STAGE = "continuous-eval"

# The state file decides what is done: Prefect neither caches these results nor persists them.
evaluate_step = task(evaluate_checkpoint, name="evaluate-checkpoint", task_run_name="step-{step}",
                     cache_policy=NO_CACHE)


def eval_targets(cfg: KilnConfig, keys: dict[str, str]) -> list[EvalTarget]:
    """One target per training stage of `cfg`, located in the store by its key."""
    store = Store(cfg.store_root)
    tokenizer = store.path("tokenize", keys["tokenize"]) / TOKENIZER_FILE
    anneal_every = anneal_checkpointing(cfg.anneal, cfg.train.run)["checkpoint_every"]
    return [eval_target(cfg.continuous_eval, cfg.evaluate, stage="train", key=keys["train"],
                        checkpoint_every=cfg.train.run.checkpoint_every, store=store, tokenizer=tokenizer,
                        work_dir=Path(cfg.work_dir)),
            # every anneal checkpoint: `continuous_eval.every` thins the train stage's only
            eval_target(cfg.continuous_eval.model_copy(update={"every": None}), cfg.evaluate, stage="anneal",
                        key=keys["anneal"], checkpoint_every=anneal_every, store=store, tokenizer=tokenizer,
                        work_dir=Path(cfg.work_dir))]


def ecg_path(cfg: KilnConfig, keys: dict[str, str]) -> Path:
    """Where the ECG of `cfg`'s training run is drawn."""
    return Path(cfg.work_dir) / "continuous_eval" / keys["train"] / ECG_FILE


def up_to_date(cfg: KilnConfig, keys: dict[str, str]) -> bool:
    """A pass would change nothing: every due checkpoint of both training stages is scored at the current
    task versions, none was missed, and the ECG is drawn. Read from the state files, without a flow run."""
    if not ecg_path(cfg, keys).is_file():
        return False
    targets = eval_targets(cfg, keys)
    versions = suite_versions(targets[0].evaluate)
    plans = [plan_evaluations(target, versions) for target in targets]
    return not any(plan.due or plan.missed for plan in plans)


def config_name(config_path: str | None) -> str:
    """The name in the regression event's resource id: the config file's stem (`configs/tiny.yaml` -> `tiny`)."""
    return Path(config_path).stem if config_path else "default"


def _suite_digest(versions: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]


def _mirror_to_mlflow(cfg: KilnConfig, target: EvalTarget, rows: dict[tuple[int, str], dict[str, Any]],
                      versions: dict[str, str]) -> tuple[str | None, list[int]]:
    """Log each step of the current rows that the MLflow run lacks, at its step; returns the run id and those steps.

    The run is found by stage key, eval key and the digest of the task versions: a changed suite gets
    a new run whose curves hold only the current versions' scores."""
    if not rows:
        return None, []
    tracker = MlflowTracker.for_config(cfg)
    tags = {"kiln.stage": RUN_STAGE, "kiln.evaluated_stage": target.stage, "kiln.key": target.stage_key,
            "kiln.eval_key": target.eval_key, "kiln.suite_digest": _suite_digest(versions)}
    run_id = tracker.find_run(tags)
    if run_id is None:
        run_id = tracker.start_run(f"{RUN_STAGE}/{target.stage}/{target.stage_key}", tags=tags,
                                   params={"evaluate": target.evaluate.model_dump(mode="json"),
                                           "state_file": str(target.state_file)})
        tracker.set_tags(run_id, {f"kiln.task_version.{t}": v for t, v in versions.items()})
        tracker.log_input(run_id, target.stage, target.stage_key, target.store.path(target.stage, target.stage_key))
    # each task's document count is in every row: its history says which steps the run has
    logged = {name: tracker.metric_steps(run_id, f"{name}/num_docs") for name in {t for _, t in rows}}
    new: list[int] = []
    for (step, task_name), row in sorted(rows.items()):
        if step in logged[task_name]:
            continue
        tracker.log_metrics(run_id, {**row["metrics"], f"{task_name}/eval_wall_s": row["wall_s"]}, step)
        new.append(step)
    new = sorted(set(new))
    if new:
        tracker.set_tags(run_id, {"kiln.prefect_flow_run_id": str(flow_run.get_id() or "none"),
                                  "kiln.last_step": max(new)})
        tracker.end_run(run_id)
    return run_id, new


def _publish_table(target: EvalTarget, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    create_table_artifact([{c: row.get(c, "") for c in columns} for row in rows], key=f"kiln-continuous-eval-{target.stage}",
                          description=f"Kiln continuous eval of {target.stage} {target.stage_key} (eval {target.eval_key})")


def _publish_ecg(path: Path, regressions: list[tuple[str, Regression]]) -> None:
    """The plot inline (a data URI, so the Prefect UI shows it without a file server) and where it lies."""
    image = base64.b64encode(path.read_bytes()).decode("ascii")
    lines = ["# Kiln ECG", "", f"Each task's main score against the training step: `{path.resolve()}`", "",
             f"![ECG](data:image/png;base64,{image})", ""]
    if regressions:
        lines += ["| stage | task | metric | step | best (step) | current | tolerance |", "|---|---|---|---:|---:|---:|---:|"]
        lines += [f"| {stage} | {r.task} | {r.metric} | {r.step} | {r.best:.4f} ({r.best_step}) | {r.current:.4f} | {r.tolerance} |"
                  for stage, r in regressions]
    create_markdown_artifact("\n".join(lines) + "\n", key="kiln-ecg", description="Kiln continuous eval: the ECG")


@flow(name="kiln-continuous-eval", validate_parameters=True,
      description="Kiln continuous eval: lm-eval scores of each new train and anneal checkpoint, logged to MLflow at "
                  "its step, the ECG plot, and an event when a score regresses.")
def continuous_eval(config_path: str | None = "configs/default.yaml",
                    overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    cfg = load_config(config_path, list(overrides or []))
    apply_run_settings(cfg)  # a worker's flow-run process gets what the CLI sets
    keys = stage_keys(cfg)
    targets = eval_targets(cfg, keys)
    versions = suite_versions(targets[0].evaluate)  # the same settings for both stages
    summaries = {target.stage: _evaluate_target(cfg, target, versions) for target in targets}
    series = {t.stage: curves(current_rows(read_recorded(t.state_file), versions)) for t in targets}
    regressions = [(stage, r) for stage in summaries for r in summaries[stage]["regressions_found"]]
    for stage, regression in regressions:
        emit_event(event=REGRESSION_EVENT, resource={"prefect.resource.id": f"kiln.eval.{config_name(config_path)}"},
                   payload={**regression.payload(), "stage": stage, "stage_key": keys[stage]})
    path = ecg_path(cfg, keys)
    drawn = None
    if any(series.values()) and (any(s["evaluated"] for s in summaries.values()) or not path.is_file()):
        # the anneal continues from a train checkpoint (anneal.from_step, else the last): its curve starts there
        anneal_start = cfg.train.run.steps if cfg.anneal.from_step is None else cfg.anneal.from_step
        drawn = plot_ecg(series, {"anneal": anneal_start}, path,
                         {(stage, r.task, r.step) for stage, r in regressions})
        tracker = MlflowTracker.for_config(cfg)
        for summary in summaries.values():
            if summary["mlflow_run_id"]:
                tracker.log_artifact(summary["mlflow_run_id"], drawn)
        _publish_ecg(drawn, regressions)
    for summary in summaries.values():
        summary["regressions"] = [r.payload() for r in summary.pop("regressions_found")]
        summary["ecg"] = str(path) if path.is_file() else None
        summary["ecg_drawn"] = drawn is not None
    return summaries


def _evaluate_target(cfg: KilnConfig, target: EvalTarget, versions: dict[str, str]) -> dict[str, Any]:
    logger = get_run_logger()
    plan = plan_evaluations(target, versions)
    outcomes = [evaluate_step(target, step, tasks) for step, tasks in plan.due.items()]
    for outcome in outcomes:
        if outcome.evaluated:
            logger.info("%s step %d evaluated on %s in %.1fs", target.stage, outcome.step, list(outcome.tasks),
                        outcome.wall_s)
        else:
            logger.warning("%s step %d skipped: %s", target.stage, outcome.step, outcome.reason)
    if plan.missed:
        logger.warning("%s steps %s were pruned before any run evaluated them: set train.run.keep_every=%d "
                       "so that training keeps them", target.stage, plan.missed, target.every)
    recorded = read_recorded(target.state_file)
    rows = current_rows(recorded, versions)
    run_id, logged = _mirror_to_mlflow(cfg, target, rows, versions)
    new = {(o.step, t) for o in outcomes if o.evaluated for t in o.tasks}
    tolerance = cfg.continuous_eval.regression_tolerance
    regressions = find_regressions(curves(rows), new, tolerance) if tolerance is not None else []
    for r in regressions:
        logger.warning("%s %s regressed at step %d: %s %.4f, best %.4f at step %d (tolerance %s)", target.stage,
                       r.task, r.step, r.metric, r.current, r.best, r.best_step, r.tolerance)
    if outcomes or plan.missed:
        _publish_table(target, scores_table(recorded, versions, outcomes, plan.missed))
    else:
        logger.info("nothing new to evaluate for %s %s (%d steps recorded)", target.stage, target.stage_key,
                    len(recorded_steps(rows)))
    return {
        "key": target.stage_key, "eval_key": target.eval_key, "state_file": str(target.state_file),
        "evaluated": [o.step for o in outcomes if o.evaluated],
        "skipped": {str(o.step): o.reason for o in outcomes if not o.evaluated},
        "missed": plan.missed, "recorded": recorded_steps(rows), "mlflow_run_id": run_id, "mlflow_steps_logged": logged,
        "regressions_found": regressions,
    }
