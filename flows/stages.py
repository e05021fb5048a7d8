"""Prefect's view of Kiln's stages: one cached task around the plain-Python runner, one flow per stage.

`stage_task` wraps `tasks.runner.run_stage` (which locks the key, reuses or computes it, writes
the manifest, commits and records the MLflow run, named and tagged with the flow run's attempt).
Its cache key is the stage and its key, with results persisted, so a stage the store already has
shows as `Cached` (a key committed without Prefect's record of it gets one first) and a UI Retry
re-executes only what failed. Retries (`orchestration.retries`) apply to infrastructure failures
and unexpected errors (`tasks.errors.is_retryable`), never to user errors; a retry resumes the
stage from its partial folder, where its committed sub-runs (sweep trials, transfer runs,
branches) are reused, and a sub-run's own failures (a killed trial job) are retried inside the
stage first. The stage flows (`kiln-collect`, ...) are generated from the registry, one per stage,
so each has its own deployment; each loads its config once, marks what a crash left running
(`flows.crashes`) and runs its stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.events import emit_event
from prefect.runtime import flow_run

from kiln.flows.alerts import TEXT, stage_event_text
from kiln.flows.crashes import reap_crashed
from kiln.flows.environment import apply_run_settings
from kiln.tasks.config import default_config_path, load_config
from kiln.tasks.errors import is_retryable
from kiln.tasks.graph import stage_keys
from kiln.tasks.launch.cluster import where_it_ran
from kiln.tasks.runner import StageOutcome, run_stage
from kiln.tasks.settings import KilnConfig, open_tracker
from kiln.tasks.stages import REGISTRY
from kiln.tasks.store import MANIFEST_FILE, Store

PREFECT_CACHE_DIR = ".prefect-cache"  # under the store root



def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    return f"kiln-{parameters['name']}-{parameters['key']}"


def _retry_if_it_can_help(task: Any, task_run: Any, state: Any) -> bool:
    """Retry infrastructure failures and unexpected errors; never a config or data error, nor a diverged
    run (the user must change the config, the data or the plan)."""
    error = state.data
    return is_retryable(error)


def _flow_run_id() -> str | None:
    run_id = flow_run.get_id()
    return str(run_id) if run_id else None


def _attempt() -> int:
    """Which run of its flow run this is: 2 and up after a retry (the UI's Retry, `retries=`)."""
    return max(flow_run.run_count, 1)


def _emit(name: str, key: str):
    """The runner's event hook: each event goes to Prefect with its alert sentence (`flows.alerts`)."""
    def on_event(event_name: str, payload: dict[str, Any]) -> None:
        emit_event(event=event_name, resource={"prefect.resource.id": f"kiln.{name}.{key}"},
                   payload={**{k: str(v) for k, v in payload.items()},
                            TEXT: stage_event_text(event_name, payload, name, key)})
    return on_event


@task(name="stage", cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key), persist_result=True,
      task_run_name="{name}-{key}", retry_condition_fn=_retry_if_it_can_help)
def stage_task(name: str, key: str, cfg: KilnConfig, keys: dict[str, str], parent_run_id: str | None) -> dict[str, Any]:
    """Run (or reuse) one stage through the runner; the result is its outcome."""
    outcome = run_stage(name, cfg, tracker=open_tracker(cfg), keys=keys, parent_run_id=parent_run_id,
                        flow_run_id=_flow_run_id(), attempt=_attempt(), on_event=_emit(name, key))
    get_run_logger().info("stage %s %s: %s", name, outcome.status, outcome.path)
    return outcome.as_dict()


def execute(name: str, cfg: KilnConfig, keys: dict[str, str], parent_run_id: str | None = None) -> StageOutcome:
    """One stage inside a flow: the cached task, then its Prefect artifacts if it ran (a reused stage's
    are those its run published)."""
    key = keys[name]
    store = Store(cfg.store_root)
    complete = store.is_complete(name, key)
    orchestration = cfg.orchestration
    # Cache records and results live in the store, not in this process's PREFECT_HOME: a stage
    # built by the CLI shows as Cached to a worker sharing the store, and the other way round.
    shared = Path(cfg.store_root).resolve() / PREFECT_CACHE_DIR
    if complete:
        _record_reuse(store, name, key, shared)
    state = stage_task.with_options(
        result_storage=shared, refresh_cache=not complete, retries=orchestration.retries,
        retry_delay_seconds=orchestration.retry_delay_seconds,
    )(name, key, cfg, keys, parent_run_id, return_state=True)
    if state.name == "Cached":
        # Prefect returned the stored result without running the body: record the reuse through the
        # runner (it finds the key complete), so MLflow shows this run's cached stage too
        outcome = run_stage(name, cfg, tracker=open_tracker(cfg), keys=keys,
                            parent_run_id=parent_run_id, flow_run_id=_flow_run_id(), attempt=_attempt())
    else:
        outcome = StageOutcome(**state.result())
    if outcome.status == "ran":  # a reused stage's table and reports are those its run published
        _publish(outcome)
    return outcome


def _record_reuse(store: Store, name: str, key: str, shared: Path) -> None:
    """Give a key the store has complete Prefect's cache record for it, if it has none, so that Prefect
    shows the reuse as Cached like every other: the store decides what is done, and a key can be complete
    without a record (committed by a notebook or a Slurm job through the runner, or by a run whose
    process died between the store's commit and Prefect's record)."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore

    results = ResultStore(result_storage=LocalFileSystem(basepath=str(shared)))
    cache_key = _cache_key(None, {"name": name, "key": key})
    if not results.exists(cache_key):
        manifest = store.manifest(name, key)
        outcome = StageOutcome(name, key, "cached", 0.0, manifest["stats"].get("headline", {}),
                               str(store.path(name, key)), manifest["mlflow_run_id"])
        results.write(outcome.as_dict(), key=cache_key)


def _publish(outcome: StageOutcome) -> None:
    stage = REGISTRY[outcome.stage]
    rows = [{"metric": k, "value": v} for k, v in outcome.headline.items()]
    rows += [{"metric": "status", "value": outcome.status}, {"metric": "key", "value": outcome.key},
             {"metric": "wall_s", "value": round(outcome.wall_s, 2)}]
    create_table_artifact(rows, key=f"kiln-{stage.name}", description=f"Kiln {stage.name}: {stage.description}")
    manifest = json.loads((Path(outcome.path) / MANIFEST_FILE).read_text())
    where = where_it_ran(manifest.get("launch", {}))
    if where:
        create_markdown_artifact("\n".join(f"- {line}" for line in where), key=f"kiln-{stage.name}-where",
                                 description=f"Kiln {stage.name}: where its runs ran (launcher, jobs, nodes, relaunches)")
    for report in stage.reports:
        path = Path(outcome.path) / report
        if path.is_file():
            create_markdown_artifact(path.read_text(), key=f"kiln-{stage.name}-{path.stem}",
                                     description=f"Kiln {stage.name}: {path.name}")


def _make_stage_flow(name: str):
    def run_one(config_path: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
        cfg = load_config(config_path or default_config_path(), list(overrides or []))
        apply_run_settings(cfg)  # a worker's flow-run process gets what the CLI sets
        reap_crashed(open_tracker(cfg))
        return execute(name, cfg, stage_keys(cfg)).as_dict()

    run_one.__name__ = name.replace("-", "_")
    run_one.__doc__ = f"Kiln stage `{name}`: {REGISTRY[name].description}."
    return flow(run_one, name=f"kiln-{name}", description=run_one.__doc__, validate_parameters=True)


# one module attribute per stage (`flows.stages:train`), the entrypoints of the deployments
STAGE_FLOWS = {name: _make_stage_flow(name) for name in REGISTRY.names()}
globals().update({name.replace("-", "_"): stage_flow for name, stage_flow in STAGE_FLOWS.items()})


def flow_for(name: str):
    """The flow of stage `name`, made on first use for a stage registered after import (tests, plugins)."""
    if name not in STAGE_FLOWS:
        STAGE_FLOWS[name] = _make_stage_flow(name)
    return STAGE_FLOWS[name]
