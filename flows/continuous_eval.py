"""The continuous-eval flow (DESIGN's "watch" row): scores each new train and anneal checkpoint while
those stages run.

The `continuous-eval` deployment in infra/prefect.yaml runs it on a schedule. For each training
stage (train, anneal), each run evaluates, one Prefect task per checkpoint, the committed
checkpoints at multiples of `continuous_eval.every` that the state file beside the data does not
list yet (`tasks.evals.continuous`), then mirrors the state file into one MLflow run per stage key
and eval settings, each checkpoint's scores at its step, and publishes the curve so far as a
table. A run with nothing new changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.environment import apply_run_settings
from tasks.config import KilnConfig, load_config
from tasks.data.tokenize import TOKENIZER_FILE
from tasks.evals.continuous import (
    EvalTarget,
    eval_target,
    evaluate_checkpoint,
    plan_evaluations,
    read_recorded,
    scores_table,
)
from tasks.graph import stage_keys
from tasks.store import Store
from tasks.tracking import MlflowTracker

RUN_STAGE = "continuous-eval"
TRAINING_STAGES = ("train", "anneal")  # both checkpoint at train.run.checkpoint_every
# Every evaluate_model result holds it, so its history in MLflow says which steps are logged.
LOGGED_SENTINEL = "num_eval_docs"

# The state file decides what is done: Prefect neither caches these results nor persists them.
evaluate_step = task(evaluate_checkpoint, name="evaluate-checkpoint", task_run_name="step-{step}",
                     cache_policy=NO_CACHE)


def eval_targets(cfg: KilnConfig, keys: dict[str, str]) -> list[EvalTarget]:
    """One target per training stage of `cfg`, located in the store by its key."""
    store = Store(cfg.store_root)
    tokenizer = store.path("tokenize", keys["tokenize"]) / TOKENIZER_FILE
    return [eval_target(cfg.continuous_eval, cfg.evaluate, stage=stage, key=keys[stage],
                        checkpoint_every=cfg.train.run.checkpoint_every, store=store, tokenizer=tokenizer,
                        work_dir=Path(cfg.work_dir)) for stage in TRAINING_STAGES]


def _mirror_to_mlflow(cfg: KilnConfig, target: EvalTarget,
                      recorded: dict[int, dict[str, Any]]) -> tuple[str | None, list[int]]:
    """Log each recorded step that the MLflow run lacks, at its step; returns the run id and those steps."""
    if not recorded:
        return None, []
    tracker = MlflowTracker.for_config(cfg)
    tags = {"kiln.stage": RUN_STAGE, "kiln.evaluated_stage": target.stage, "kiln.key": target.stage_key,
            "kiln.eval_key": target.eval_key}
    run_id = tracker.find_run(tags)
    if run_id is None:
        run_id = tracker.start_run(f"{RUN_STAGE}/{target.stage}/{target.stage_key}", tags=tags,
                                   params={"evaluate": target.evaluate.model_dump(mode="json"),
                                           "state_file": str(target.state_file)})
        tracker.log_input(run_id, target.stage, target.stage_key, target.store.path(target.stage, target.stage_key))
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
    create_table_artifact([{c: row.get(c, "") for c in columns} for row in rows], key=f"kiln-continuous-eval-{target.stage}",
                          description=f"Kiln continuous eval of {target.stage} {target.stage_key} (eval {target.eval_key})")


@flow(name="kiln-continuous-eval", validate_parameters=True,
      description="Kiln continuous eval: lm-eval scores of each new train and anneal checkpoint, logged to MLflow at its step.")
def continuous_eval(config_path: str | None = "configs/default.yaml",
                    overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    cfg = load_config(config_path, list(overrides or []))
    apply_run_settings(cfg)  # a worker's flow-run process gets what the CLI sets
    return {target.stage: _evaluate_target(cfg, target) for target in eval_targets(cfg, stage_keys(cfg))}


def _evaluate_target(cfg: KilnConfig, target: EvalTarget) -> dict[str, Any]:
    logger = get_run_logger()
    plan = plan_evaluations(target)
    outcomes = [evaluate_step(target, step) for step in plan.due]
    for outcome in outcomes:
        if outcome.evaluated:
            logger.info("%s step %d evaluated in %.1fs", target.stage, outcome.step, outcome.wall_s)
        else:
            logger.warning("%s step %d skipped: %s", target.stage, outcome.step, outcome.reason)
    if plan.missed:
        logger.warning("%s steps %s were pruned before any run evaluated them: set train.run.keep_every=%d "
                       "so that training keeps them", target.stage, plan.missed, target.every)
    recorded = read_recorded(target.state_file)
    run_id, logged = _mirror_to_mlflow(cfg, target, recorded)
    if outcomes or plan.missed:
        _publish(target, scores_table(recorded, outcomes, plan.missed))
    else:
        logger.info("nothing new to evaluate for %s %s (%d steps recorded)", target.stage, target.stage_key, len(recorded))
    return {
        "key": target.stage_key, "eval_key": target.eval_key, "state_file": str(target.state_file),
        "evaluated": [o.step for o in outcomes if o.evaluated],
        "skipped": {str(o.step): o.reason for o in outcomes if not o.evaluated},
        "missed": plan.missed, "recorded": sorted(recorded), "mlflow_run_id": run_id, "mlflow_steps_logged": logged,
    }
