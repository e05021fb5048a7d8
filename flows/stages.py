"""One Prefect flow per stage, each a thin recipe around `tasks.stages.STAGE_BODIES`.

A stage flow resolves its inputs from the store by key (so it runs alone, from a deployment
or the UI, as well as inside the pipeline), and calls one cached Prefect task that does the
work, records the MLflow run and commits the output. The store decides what is done: a
complete key is returned without work; Prefect's cache (keyed on the stage key, results
persisted) shows such a stage as `Cached` in the UI.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run

from tasks.config import KilnConfig, load_config
from tasks.errors import KilnError
from tasks.graph import SPECS, STAGE_NAMES, config_value, stage_identity, stage_keys
from tasks.provenance import code_version, provenance
from tasks.stages import STAGE_BODIES, StageContext
from tasks.store import Store
from tasks.tracking import Tracker

_SMALL_ARTIFACT_SUFFIXES = (".json", ".md", ".png")
_SMALL_ARTIFACT_BYTES = 5_000_000


def tracker_for(cfg: KilnConfig) -> Tracker:
    return Tracker(cfg.tracking_uri, cfg.tracking.experiment, Path(cfg.work_dir) / "mlartifacts")


def _stage_params(cfg: KilnConfig, name: str) -> dict[str, Any]:
    """The stage's config sections as logged params (runtime fields included, for the record)."""
    params: dict[str, Any] = {}
    for dotted in SPECS[name].sections:
        value = config_value(cfg, dotted)
        params[dotted] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return params


def _numeric(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if key == "headline":
            continue
        if isinstance(value, dict):
            flat.update(_numeric(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = value
    return flat


def _flow_run_id() -> str:
    return str(flow_run.get_id() or "none")


def _stage_tags(name: str, key: str, cfg: KilnConfig) -> dict[str, str]:
    code = code_version()
    return {"kiln.stage": name, "kiln.key": key, "kiln.prefect_flow_run_id": _flow_run_id(),
            "kiln.git_sha": code["git_sha"], "kiln.git_dirty": str(code["git_dirty"]), "kiln.work_dir": cfg.work_dir}


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    return f"kiln-{parameters['name']}-{parameters['key']}"


@task(name="execute-stage", cache_key_fn=_cache_key, persist_result=True, task_run_name="{name}-{key}")
def execute_stage(name: str, key: str, config_path: str | None, overrides: list[str],
                  input_keys: dict[str, str], parent_run_id: str | None) -> dict[str, Any]:
    """Run one stage body into the store (or return its manifest if another run already did)."""
    cfg = load_config(config_path, overrides)
    store = Store(cfg.store_root)
    if store.is_complete(name, key):
        return store.manifest(name, key)
    spec = SPECS[name]
    inputs = {i: store.path(i, input_keys[i]) for i in spec.inputs}
    tracker = tracker_for(cfg)
    run_id = tracker.start_run(name, parent_id=parent_run_id, tags={**_stage_tags(name, key, cfg), "kiln.status": "ran"},
                               params=_stage_params(cfg, name))
    for input_name, path in inputs.items():
        tracker.log_input(run_id, input_name, input_keys[input_name], path)

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        tracker.log_metrics(run_id, metrics, step)

    def on_trial(trial: Any) -> None:
        trial_run = tracker.start_run(trial.name, parent_id=run_id, tags={"kiln.stage": "sweep-trial"},
                                      params={"lr": trial.lr, "width": trial.width, "mixture": trial.mixture,
                                              "num_params": trial.num_params})
        tracker.log_metrics(trial_run, {"val_loss": trial.val_loss, "final_train_loss": trial.final_train_loss,
                                        "tokens_seen": trial.tokens_seen, "wall_s": trial.wall_s,
                                        **{f"val_loss.{d}": v for d, v in trial.val_loss_by_domain.items()}})
        tracker.end_run(trial_run)

    def on_event(event: dict[str, Any]) -> None:
        # A rollback or abort is an MLflow tag and metric, and a Prefect event an automation can alert on.
        tracker.set_tags(run_id, {f"kiln.health.step_{event['step']}": f"{event['kind']}: {event.get('action')}"})
        loss = event.get("loss")
        tracker.log_metrics(run_id, {"health.event_loss": loss if isinstance(loss, (int, float)) else float("nan")},
                            event["step"])
        emit_event(event=f"kiln.train.{event.get('action', 'event')}", resource={"prefect.resource.id": f"kiln.{name}.{key}"},
                   payload={k: str(v) for k, v in event.items()})

    out_dir = store.begin(name, key, resumable=spec.resumable)
    started = time.perf_counter()
    try:
        stats = STAGE_BODIES[name](cfg, StageContext(out_dir, inputs, store.root, on_metrics, on_trial, on_event))
    except BaseException as error:
        tracker.set_tags(run_id, {"kiln.error": str(error)[:5000]})
        tracker.end_run(run_id, failed=True)
        raise
    wall_s = time.perf_counter() - started
    manifest = {
        "stage": name, "key": key, "format_version": spec.version, "inputs": input_keys,
        "identity": stage_identity(name, cfg), "stats": stats, "wall_s": wall_s,
        "mlflow_run_id": run_id, "prefect_flow_run_id": _flow_run_id(), "provenance": provenance(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2, default=str))
    tracker.log_metrics(run_id, {**_numeric(stats), "wall_s": wall_s})
    for path in sorted(out_dir.iterdir()):
        if path.suffix in _SMALL_ARTIFACT_SUFFIXES and path.stat().st_size < _SMALL_ARTIFACT_BYTES:
            tracker.log_artifact(run_id, path)
    final = store.commit(name, key, manifest)
    tracker.log_dict(run_id, manifest, "manifest.json")
    tracker.end_run(run_id)
    get_run_logger().info("stage %s committed to %s in %.1fs", name, final, wall_s)
    return manifest


def _publish(name: str, outcome: dict[str, Any]) -> None:
    rows = [{"metric": k, "value": v} for k, v in outcome["headline"].items()]
    rows += [{"metric": "status", "value": outcome["status"]}, {"metric": "key", "value": outcome["key"]},
             {"metric": "wall_s", "value": round(outcome["wall_s"], 2)}]
    create_table_artifact(rows, key=f"kiln-{name}", description=f"Kiln {name}: {SPECS[name].description}")
    report = Path(outcome["path"]) / "compliance.md"
    if report.is_file():
        create_markdown_artifact(report.read_text(), key=f"kiln-{name}-report", description="licence compliance")


def run_stage(name: str, config_path: str | None = None, overrides: list[str] | None = None,
              parent_run_id: str | None = None) -> dict[str, Any]:
    """The body shared by every stage flow: resolve keys and inputs, run or reuse, publish."""
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    keys = stage_keys(cfg)
    key = keys[name]
    store = Store(cfg.store_root)
    spec = SPECS[name]
    missing = [i for i in spec.inputs if not store.is_complete(i, keys[i])]
    if missing:
        raise KilnError(f"stage {name} needs {', '.join(missing)} first (not complete in {store.root}): "
                        f"run `kiln run {config_path or ''} --until {missing[-1]}` or the whole pipeline")
    complete = store.is_complete(name, key)
    started = time.perf_counter()
    state = execute_stage.with_options(refresh_cache=not complete)(
        name, key, config_path, overrides, {i: keys[i] for i in spec.inputs}, parent_run_id, return_state=True)
    manifest = state.result()
    cached = complete
    outcome = {"stage": name, "key": key, "status": "cached" if cached else "ran",
               "wall_s": manifest["wall_s"] if not cached else time.perf_counter() - started,
               "headline": manifest["stats"].get("headline", {}), "path": str(store.path(name, key)),
               "mlflow_run_id": manifest["mlflow_run_id"]}
    if cached and parent_run_id:
        tracker = tracker_for(cfg)
        run_id = tracker.start_run(name, parent_id=parent_run_id,
                                   tags={**_stage_tags(name, key, cfg), "kiln.status": "cached",
                                         "kiln.source_run_id": manifest["mlflow_run_id"]})
        tracker.end_run(run_id)
    _publish(name, outcome)
    return outcome


def _make_stage_flow(name: str):
    def stage(config_path: str | None = "configs/default.yaml", overrides: list[str] | None = None,
              parent_run_id: str | None = None) -> dict[str, Any]:
        return run_stage(name, config_path, overrides, parent_run_id)

    stage.__name__ = name
    stage.__doc__ = f"Kiln stage `{name}`: {SPECS[name].description}."
    return flow(stage, name=f"kiln-{name}", description=stage.__doc__, validate_parameters=True)


collect = _make_stage_flow("collect")
clean = _make_stage_flow("clean")
dedup = _make_stage_flow("dedup")
decontaminate = _make_stage_flow("decontaminate")
tokenize = _make_stage_flow("tokenize")
sweep = _make_stage_flow("sweep")
fit = _make_stage_flow("fit")
mix = _make_stage_flow("mix")
validate = _make_stage_flow("validate")
train = _make_stage_flow("train")
anneal = _make_stage_flow("anneal")
evaluate = _make_stage_flow("evaluate")

STAGE_FLOWS = {name: getattr(sys.modules[__name__], name) for name in STAGE_NAMES}
