"""The continuous-eval flow (DESIGN's "watch" row): scores each new train and anneal checkpoint while
those stages run, draws the electrocardiogram, raises an event where a regression starts or clears,
and pauses its own schedule once there is nothing left to watch.

The `continuous-eval` deployment runs it on a schedule (`kiln deploy --continuous-eval CONFIG
[--every 60s]`; the interval is `continuous_eval.interval`); the pipeline's end-of-run pass and
`kiln continuous-eval` run it once. For each training stage (train, anneal), each run evaluates,
one Prefect task per checkpoint, the committed checkpoints at multiples of `continuous_eval.every`
on the configured tasks the state file beside the data does not list at their current version
(`tasks.evals.continuous`, which locks each step against the other scorers), then mirrors the state
file into one MLflow run per stage key, eval settings and task versions (`continuous-eval/train/<key>`,
`continuous-eval/anneal/<key>`), each checkpoint's scores at its step. When anything new was scored it:

- emits, for each regression that starts or clears at a new score (judged against the score's noise,
  `tasks.evals.ecg`), the Prefect event `kiln.eval.regression` or `kiln.eval.regression.cleared`
  (resource `kiln.eval.<config name>`; payload task, metric, step, best, current, noise, since, and
  the alert's sentence in `text`);
- draws the ECG, each task's main score against the step (train, then anneal), every regression
  event marked, to `{work_dir}/continuous_eval/{train key}/ecg.png`, logged to both MLflow runs and
  published with the table of scores as Prefect artifacts.

A scheduled run that finds both stages complete and everything they kept scored pauses its
deployment (which deletes the runs Prefect had scheduled ahead) and says so in its log and an
artifact; `kiln deploy --continuous-eval` switches it on again. A run with nothing new changes nothing.
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
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.runtime import flow_run

from kiln.flows.alerts import TEXT, adjust_command, phases_override, regression_text
from kiln.flows.environment import apply_run_settings
from kiln.tasks.config import default_config_path, load_config
from kiln.tasks.continuous_state import (
    WATCHED,
    anneal_offset,
    ecg_path,
    eval_targets,
    evaluate_trust,
    watched_complete,
)
from kiln.tasks.evals.continuous import (
    EvalTarget,
    current_rows,
    evaluate_checkpoint,
    plan_evaluations,
    read_recorded,
    recorded_steps,
    scores_table,
    series_lock,
    suite_versions,
)
from kiln.tasks.evals.evaluate import suite_tasks
from kiln.tasks.constants import BATCH_PREFIX
from kiln.tasks.evals.ecg import (
    RegressionEvent,
    all_events,
    curves,
    open_regressions,
    plot_ecg,
    schedule_marks,
    trusted_events,
)
from kiln.tasks.evals.suite import task_domains
from kiln.tasks.graph import stage_keys
from kiln.tasks.settings import KilnConfig, open_tracker
from kiln.tasks.store import Store
from kiln.tasks.train.checkpoint import mixture_history

RUN_STAGE = "continuous-eval"

# The state file decides what is done: Prefect neither caches these results nor persists them.
evaluate_step = task(evaluate_checkpoint, name="evaluate-checkpoint", task_run_name="step-{step}",
                     cache_policy=NO_CACHE)


def config_name(config_path: str | None) -> str:
    """The name in the regression event's resource id: the config file's stem (`configs/tiny.yaml` -> `tiny`)."""
    return Path(config_path).stem if config_path else "default"


def _suite_digest(versions: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]


def _mirror_to_mlflow(cfg: KilnConfig, target: EvalTarget, rows: dict[tuple[int, str], dict[str, Any]],
                      versions: dict[str, str]) -> tuple[str | None, list[int]]:
    """Log each step of the current rows that the MLflow run lacks, at its step; returns the run id and those steps.

    The run is found by stage key, eval key and the digest of the task versions: a changed suite gets
    a new run whose curves hold only the current versions' scores. Another scorer mirroring the same
    series waits (`series_lock`), so neither the run nor a step is logged twice."""
    if not rows:
        return None, []
    tracker = open_tracker(cfg)
    tags = {"kiln.stage": RUN_STAGE, "kiln.evaluated_stage": target.stage, "kiln.key": target.stage_key,
            "kiln.eval_key": target.eval_key, "kiln.suite_digest": _suite_digest(versions)}
    with series_lock(target):
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
            if step in logged[task_name] or row.get("skipped"):  # skipped: nothing scored to log
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


def _publish_ecg(path: Path, events: list[tuple[str, RegressionEvent]]) -> None:
    """The plot inline (a data URI, so the Prefect UI shows it without a file server), where it lies, and
    every regression event of the series."""
    image = base64.b64encode(path.read_bytes()).decode("ascii")
    lines = ["# Kiln ECG", "", f"Each task's main score against the training step: `{path.resolve()}`", "",
             f"![ECG](data:image/png;base64,{image})", ""]
    if events:
        lines += ["| stage | task | metric | step | regression | current | best (step) | noise |",
                  "|---|---|---|---:|---|---:|---:|---:|"]
        lines += [f"| {stage} | {e.task} | {e.metric} | {e.step} | {e.kind} | {e.current:.4f} | {e.best:.4f} "
                  f"({e.best_step}) | {e.noise:.4f} |" for stage, e in events]
    create_markdown_artifact("\n".join(lines) + "\n", key="kiln-ecg", description="Kiln continuous eval: the ECG")


def _emit(config_path: str | None, stage: str, key: str, event: RegressionEvent, text: str,
          upweight_by: tuple[str, str] | None) -> None:
    action = {} if upweight_by is None else {"domain": upweight_by[0], "adjust_command": upweight_by[1]}
    emit_event(event=event.event, resource={"prefect.resource.id": f"kiln.eval.{config_name(config_path)}"},
               payload={**event.payload(), "stage": stage, "stage_key": key, **action, TEXT: text})


def mixture_domains(history: list) -> list[str]:
    """The domains of a train run's mixture (its latest), from its mixture history."""
    return [name for name in history[-1][1] if name != "phases" and not name.startswith(BATCH_PREFIX)] if history else []


def upweight(cfg: KilnConfig, config_path: str, overrides: list[str], event: RegressionEvent, stage: str,
             history: list, domains: dict[str, str]) -> tuple[str, str] | None:
    """The training domain a regressed train-series task measures and the `kiln adjust` command that trains the
    rest of the run from the regressed checkpoint with that domain's weight doubled (the mixture of the
    phase that step was in); None for a cleared regression, the anneal series, or a task no domain of
    the mixture matches."""
    domain = domains.get(event.task)
    if stage != "train" or event.kind != "started" or domain is None or not history:
        return None
    from kiln.tasks.train.data_schedule import upweighted_phases  # defers torch

    summary = ([entry for entry in history if entry[0] < event.step] or history[:1])[-1][1]
    weights = {name: source["weight"] for name, source in summary.items() if name != "phases"}
    phases = upweighted_phases(cfg.train.phases, summary.get("phases", []), event.step, weights, domain)
    work_dir = [o.partition("=")[2] for o in overrides if o.startswith("work_dir=")]
    changes = [o for o in overrides if not o.startswith("work_dir=")]
    return domain, adjust_command(config_path, event.step, [*changes, phases_override(phases)], *work_dir[-1:])


@flow(name="kiln-continuous-eval", validate_parameters=True,
      description="Kiln continuous eval: lm-eval scores of each new train and anneal checkpoint, logged to MLflow at "
                  "its step, the ECG plot, an event where a regression starts or clears, and the schedule paused "
                  "once both stages are complete and scored.")
def continuous_eval(config_path: str | None = None,
                    overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    config_path = config_path or default_config_path()  # the flow run's folder's kiln.yaml, else Kiln's default
    cfg = load_config(config_path, list(overrides or []))
    apply_run_settings(cfg)  # a worker's flow-run process gets what the CLI sets
    keys = stage_keys(cfg)
    targets = eval_targets(cfg, keys)
    versions = suite_versions(targets[0].evaluate)  # the same settings for both stages
    finished = watched_complete(cfg, keys)  # looked at first: a stage complete now writes nothing after the pass
    summaries = {target.stage: _evaluate_target(cfg, target, versions) for target in targets}
    ce = cfg.continuous_eval
    series = {t.stage: curves(current_rows(read_recorded(t.state_file), versions)) for t in targets}
    # Tasks the evaluate stage judged not trusted leave the regression alerts (and are drawn faint).
    trusted = evaluate_trust(cfg, keys)
    categories = {task.name: task.category for task in suite_tasks(targets[0].evaluate)}
    events, not_trusted = [], {}
    for stage in series:
        kept, not_trusted[stage] = trusted_events(all_events(series[stage], ce.regression_sigmas, ce.min_change),
                                                  trusted)
        events += [(stage, e) for e in kept]
    # The train run's data schedule as it ran: its phases and adjustments are marked on the ECG, and a
    # regression of a task that measures a domain of its mixture comes with the command that upweights it.
    train_folder = Store(cfg.store_root).live_path("train", keys["train"])
    history = mixture_history(train_folder) if train_folder is not None else []
    domains = task_domains(suite_tasks(targets[0].evaluate), mixture_domains(history)) if events else {}
    logger = get_run_logger()
    for stage, tasks in not_trusted.items():
        if tasks:
            logger.info("%s: regressions of %s left out of the alerts: the evaluate stage judged them not trusted",
                        stage, ", ".join(tasks))
    for stage, event in events:
        if (event.step, event.task) in summaries[stage]["scored_now"]:  # an event is emitted once, with its score
            upweight_by = upweight(cfg, config_path, list(overrides or []), event, stage, history, domains)
            text = regression_text(event, stage, *(upweight_by or ()))
            _emit(config_path, stage, keys[stage], event, text, upweight_by)
            logger.warning("%s", text)
    path = ecg_path(cfg, keys)
    drawn = None
    if any(series.values()) and (any(s["evaluated"] for s in summaries.values()) or not path.is_file()):
        drawn = plot_ecg(series, {"anneal": anneal_offset(cfg, targets[0])}, path, events, categories,
                         trusted or None, schedule_marks(history))
        tracker = open_tracker(cfg)
        for summary in summaries.values():
            if summary["mlflow_run_id"]:
                tracker.log_artifact(summary["mlflow_run_id"], drawn)
        _publish_ecg(drawn, events)
    for stage, summary in summaries.items():
        scored_now = summary.pop("scored_now")
        summary["regressions"] = [e.payload() for where, e in events
                                  if where == stage and (e.step, e.task) in scored_now]
        summary["open_regressions"] = [e.payload() for e in open_regressions(e for w, e in events if w == stage)]
        summary["not_trusted"] = not_trusted[stage]  # tasks whose regressions were left out: not trusted
        summary["ecg"] = str(path) if path.is_file() else None
        summary["ecg_drawn"] = drawn is not None
    paused = _pause_when_done(finished, summaries)
    for summary in summaries.values():
        summary["schedule_paused"] = paused
    return summaries


def _pause_when_done(finished: bool, summaries: dict[str, dict[str, Any]]) -> bool:
    """Pause this run's own deployment (a scheduled run's; not a pipeline's pass, nor the CLI's) once the
    watched stages were complete before this pass: it saw their last checkpoints, and none will come.
    Prefect then deletes the runs it had scheduled ahead. Says so in the log and an artifact."""
    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context is not None else None  # this run's, not a parent's
    if deployment_id is None or not finished:
        return False
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.pause_deployment(deployment_id)
    scored = "; ".join(f"{stage} steps {s['recorded']}" for stage, s in summaries.items())
    unscorable = {stage: s["skipped"] for stage, s in summaries.items() if s["skipped"]}
    message = (f"continuous eval is done: {' and '.join(WATCHED)} are complete and every checkpoint they kept is "
               f"scored ({scored})" + (f", except {unscorable}" if unscorable else "")
               + "; this deployment's schedule is now paused. `kiln deploy --continuous-eval CONFIG` switches it "
               "on again.")
    get_run_logger().warning(message)
    create_markdown_artifact(f"# Kiln continuous eval: schedule paused\n\n{message}\n",
                             key="kiln-continuous-eval-schedule", description="Kiln continuous eval: schedule paused")
    return True


def _evaluate_target(cfg: KilnConfig, target: EvalTarget, versions: dict[str, str]) -> dict[str, Any]:
    logger = get_run_logger()
    plan = plan_evaluations(target, versions)
    outcomes = [evaluate_step(target, step, tasks, versions) for step, tasks in plan.due.items()]
    for outcome in outcomes:
        if outcome.evaluated:
            logger.info("%s step %d evaluated on %s in %.1fs", target.stage, outcome.step, list(outcome.tasks),
                        outcome.wall_s)
        elif outcome.elsewhere:
            logger.info("%s step %d was scored meanwhile by another run", target.stage, outcome.step)
        else:
            logger.warning("%s step %d skipped: %s", target.stage, outcome.step, outcome.reason)
    if plan.missed:
        keeper = "train.run.keep_every" if target.stage == "train" else f"{target.stage}.keep_every"
        logger.warning("%s steps %s were pruned before any run evaluated them: set %s=%d so that training keeps "
                       "them", target.stage, plan.missed, keeper, target.every)
    recorded = read_recorded(target.state_file)
    rows = current_rows(recorded, versions)
    run_id, logged = _mirror_to_mlflow(cfg, target, rows, versions)
    if outcomes or plan.missed:
        _publish_table(target, scores_table(recorded, versions, outcomes, plan.missed))
    else:
        logger.info("nothing new to evaluate for %s %s (%d steps recorded)", target.stage, target.stage_key,
                    len(recorded_steps(rows)))
    return {
        "key": target.stage_key, "eval_key": target.eval_key, "state_file": str(target.state_file),
        "evaluated": [o.step for o in outcomes if o.evaluated],
        "skipped": {str(o.step): o.reason for o in outcomes if not o.evaluated and not o.elsewhere},
        "scored_elsewhere": [o.step for o in outcomes if o.elsewhere],
        "missed": plan.missed, "recorded": recorded_steps(rows), "mlflow_run_id": run_id, "mlflow_steps_logged": logged,
        "scored_now": {(o.step, t) for o in outcomes if o.evaluated for t in o.tasks},
    }
