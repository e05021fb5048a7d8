"""The continuous-eval flow (DESIGN's "watch" row): scores each new training checkpoint while training runs.

The `continuous-eval` deployment in infra/prefect.yaml runs it on a schedule. Each run evaluates,
one Prefect task per checkpoint, the committed checkpoints at multiples of `continuous_eval.every`
that the state file beside the data does not list yet (`tasks.evals.continuous`), then mirrors the
state file into one MLflow run per train key and eval settings, each checkpoint's scores at its
training step, and publishes the curve so far as a table. A run with nothing new changes nothing.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.stages import tracker_for
from tasks.config import KilnConfig, load_config
from tasks.evals.continuous import (
    EvalTarget,
    evaluate_checkpoint,
    plan_evaluations,
    read_recorded,
    resolve_target,
    scores_table,
)
from tasks.graph import stage_keys

RUN_STAGE = "continuous-eval"
# Every evaluate_model result holds it, so its history in MLflow says which steps are logged.
LOGGED_SENTINEL = "num_eval_docs"

# The state file decides what is done: Prefect neither caches these results nor persists them.
evaluate_step = task(evaluate_checkpoint, name="evaluate-checkpoint", task_run_name="step-{step}",
                     cache_policy=NO_CACHE)


def _mirror_to_mlflow(cfg: KilnConfig, target: EvalTarget,
                      recorded: dict[int, dict[str, Any]]) -> tuple[str | None, list[int]]:
    """Log each recorded step that the MLflow run lacks, at its step; returns the run id and those steps."""
    if not recorded:
        return None, []
    tracker = tracker_for(cfg)
    tags = {"kiln.stage": RUN_STAGE, "kiln.key": target.train_key, "kiln.eval_key": target.eval_key}
    run_id = tracker.find_run(tags)
    if run_id is None:
        run_id = tracker.start_run(f"{RUN_STAGE}/{target.train_key}", tags=tags,
                                   params={"evaluate": target.evaluate.model_dump(mode="json"),
                                           "state_file": str(target.state_file)})
        tracker.log_input(run_id, "train", target.train_key, target.checkpoint_roots[0].parent)
    logged = tracker.metric_steps(run_id, LOGGED_SENTINEL)
    new = [step for step in sorted(recorded) if step not in logged]
    for step in new:
        tracker.log_metrics(run_id, {**recorded[step]["metrics"], "eval_wall_s": recorded[step]["wall_s"]}, step)
    if new:
        tracker.set_tags(run_id, {"kiln.prefect_flow_run_id": str(flow_run.get_id() or "none"),
                                  "kiln.last_step": max(new)})
        tracker.end_run(run_id)
    return run_id, new


def _publish(target: EvalTarget, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    create_table_artifact([{c: row.get(c, "") for c in columns} for row in rows], key="kiln-continuous-eval",
                          description=f"Kiln continuous eval of train {target.train_key} (eval {target.eval_key})")


@flow(name="kiln-continuous-eval", validate_parameters=True,
      description="Kiln continuous eval: lm-eval scores of each new training checkpoint, logged to MLflow at its step.")
def continuous_eval(config_path: str | None = "configs/default.yaml",
                    overrides: list[str] | None = None) -> dict[str, Any]:
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    target = resolve_target(cfg, stage_keys(cfg))
    logger = get_run_logger()
    plan = plan_evaluations(target)
    outcomes = [evaluate_step(target, step) for step in plan.due]
    for outcome in outcomes:
        if outcome.evaluated:
            logger.info("step %d evaluated in %.1fs", outcome.step, outcome.wall_s)
        else:
            logger.warning("step %d skipped: %s", outcome.step, outcome.reason)
    if plan.missed:
        logger.warning("steps %s were pruned before any run evaluated them: set train.run.keep_every=%d "
                       "so that training keeps them", plan.missed, target.every)
    recorded = read_recorded(target.state_file)
    run_id, logged = _mirror_to_mlflow(cfg, target, recorded)
    if outcomes or plan.missed:
        _publish(target, scores_table(recorded, outcomes, plan.missed))
    else:
        logger.info("nothing new to evaluate for train %s (%d steps recorded)", target.train_key, len(recorded))
    return {
        "train_key": target.train_key, "eval_key": target.eval_key, "state_file": str(target.state_file),
        "evaluated": [o.step for o in outcomes if o.evaluated],
        "skipped": {str(o.step): o.reason for o in outcomes if not o.evaluated},
        "missed": plan.missed, "recorded": sorted(recorded), "mlflow_run_id": run_id, "mlflow_steps_logged": logged,
    }
