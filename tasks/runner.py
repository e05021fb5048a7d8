"""The stage contract in plain Python: lock the key → reuse it if complete, else begin the partial
folder → run the body → write the manifest → commit → record.

Prefect tasks, the CLI, a Slurm job and a notebook all call `run_stage`, so each gets the same
manifest, commit and tracking; the Prefect wrapper (`flows/stages.py`) adds only caching,
retries and artifacts. Two callers that want one key at the same time (two runs, two machines)
are serialised by the key's lock: the second waits, then reuses what the first committed. A stage
that fans out records its sub-runs through the run ledger (`kiln.tasks.ledger`), the same contract
one level down.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import psutil
from pydantic import BaseModel

from kiln.tasks.configbase import Section, is_runtime
from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.errors import ConfigError, KilnError, is_retryable
from kiln.tasks.graph import config_value, stage_identity, stage_keys
from kiln.tasks.keylock import KeyLock
from kiln.tasks.launch.slurm_jobs import job_alive, live_jobs, lock_holder
from kiln.tasks.ledger import StageRecorder, launch_tags, merged_launch, numeric_stats
from kiln.tasks.provenance import code_version, provenance
from kiln.tasks.settings import KilnConfig
from kiln.tasks.stage import STATS_FILE, Registry, Stage, StageContext
from kiln.tasks.stages import registry_or_default
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker, Tracker

_SMALL_ARTIFACT_SUFFIXES = (".json", ".md", ".png")
_SMALL_ARTIFACT_BYTES = 5_000_000
# launchers whose workers are no children of this process (their CPU time is added from their own records)
CLUSTER_LAUNCHERS = ("slurm", "kubernetes")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    key: str
    status: str  # "ran" or "cached"
    wall_s: float  # the stage's own time when it ran; the lookup's when cached
    headline: dict[str, Any]
    path: str
    mlflow_run_id: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stage_forecast(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A stage's forecast: each training run's, by name, and their sum, which the measured cost of the
    whole stage is set against. It covers the training runs only: a stage's evaluations and other work
    are not forecast. No sum when a run has no forecast (the first such run says why)."""
    out = {"covers": "the training runs in `runs`; evaluations and other work are not forecast", "runs": runs}
    skipped = [(name, forecast["skipped"]) for name, forecast in runs.items() if "skipped" in forecast]
    if skipped:
        name, why = skipped[0]
        return {**out, "skipped": f"{name}: {why}"}
    return {**out, **{key: sum(forecast[key] for forecast in runs.values())
                      for key in ("wall_s", "accelerator_s", "device_hours")}}


def priced_forecast(forecast: dict[str, Any] | None, accelerator_s: float) -> dict[str, float]:
    """The forecast's accelerator-seconds beside the measured ones (none when there is no forecast),
    and actual / forecast when the stage held accelerators."""
    if not forecast or "accelerator_s" not in forecast:
        return {}
    priced = {"forecast_accelerator_s": forecast["accelerator_s"]}
    if accelerator_s > 0 and forecast["accelerator_s"] > 0:
        priced["forecast_ratio"] = accelerator_s / forecast["accelerator_s"]
    return priced


def cost_headline(cost: dict[str, float]) -> dict[str, float]:
    """Device-hours spent and forecast, for a stage the planner forecast (3 significant digits)."""
    if "forecast_accelerator_s" not in cost:
        return {}
    return {"device_h": float(f"{cost['accelerator_s'] / 3600:.3g}"),
            "forecast_device_h": float(f"{cost['forecast_accelerator_s'] / 3600:.3g}")}


def _params(stage: Stage, cfg: KilnConfig) -> dict[str, Any]:
    """The stage's config sections as logged params (runtime fields included, for the record)."""
    params: dict[str, Any] = {}
    for dotted in stage.sections:
        value = config_value(cfg, dotted)
        params[dotted] = _settings(value, value.identity()) if isinstance(value, Section) else value
    return params


def _settings(section: Section, identity: dict[str, Any]) -> dict[str, Any]:
    """`section` as params: its identity and runtime fields, but no field its identity leaves out that is
    not a runtime field either: that is no setting (`train.optim.lr`, where `train.lr` decides)."""
    out: dict[str, Any] = {}
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if name not in identity and not is_runtime(field):
            continue
        if isinstance(value, Section) and isinstance(identity.get(name), dict):
            out[name] = _settings(value, identity[name])
        else:
            out[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return out


def _run_name(stage: str, attempt: int) -> str:
    """A stage run's MLflow name: the stage, and which attempt of its flow run made it after the first."""
    return stage if attempt <= 1 else f"{stage} (attempt {attempt})"


def _tags(stage: Stage, key: str, cfg: KilnConfig, flow_run_id: str | None, status: str,
          attempt: int) -> dict[str, str]:
    code = code_version()
    return {"kiln.stage": stage.name, "kiln.key": key, "kiln.status": status,
            "kiln.prefect_flow_run_id": flow_run_id or "none", "kiln.attempt": str(attempt),
            "kiln.git_sha": code["git_sha"], "kiln.git_dirty": str(code["git_dirty"]), "kiln.work_dir": cfg.work_dir,
            OWNER_TAG: process_owner()}


class _CpuMeter:
    """CPU seconds used since it was made by this process and every process below it: its finished
    children (getrusage), and the live descendants, with what they reaped (a multiprocessing
    forkserver's workers, datatrove's local ranks, a Ray cluster started here). A data stage's ranks
    that ran elsewhere (Slurm, a remote Ray cluster) it cannot see: the stage reports those
    (`executor_cpu_s` in its stats); a Slurm or Kubernetes training job's workers neither (their launch
    records' `worker_cpu_s`)."""

    def __init__(self) -> None:
        self.start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, dict[tuple[int, float], float]]:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        live = {}
        for process in psutil.Process().children(recursive=True):
            try:
                times = process.cpu_times()
                live[(process.pid, process.create_time())] = (times.user + times.system + times.children_user
                                                               + times.children_system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended meanwhile
                continue
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, live

    def used(self) -> float:
        (before, live_before), (after, live_after) = self.start, self._snapshot()
        used = after - before
        for process, seconds in live_after.items():
            used += seconds - live_before.get(process, 0.0)
        # A descendant that ended meanwhile is now in its reaper's count for its whole life: not its time before.
        used -= sum(seconds for process, seconds in live_before.items() if process not in live_after)
        return used


def _peak_rss_mb() -> float:
    """The largest peak RSS of this process and its finished children (MiB)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return max(own.ru_maxrss, children.ru_maxrss) / 1024


def run_stage(stage: Stage | str, cfg: KilnConfig, *, store: Store | None = None, tracker: Tracker | None = None,
              registry: Registry | None = None, keys: dict[str, str] | None = None,
              parent_run_id: str | None = None, flow_run_id: str | None = None, attempt: int = 1,
              on_event: Callable[[str, dict[str, Any]], None] | None = None) -> StageOutcome:
    """Run `stage` for `cfg` into the store, or reuse its complete output; returns what happened.

    `keys` (every stage's key for `cfg`) saves recomputing them per stage of a pipeline run;
    `parent_run_id` nests the tracked run under a pipeline run; `flow_run_id` and `attempt` (which run
    of that flow run this is: a retry is attempt 2) are tagged and name the tracked run;
    `on_event(name, payload)` receives training health events."""
    registry = registry_or_default(registry)
    stage = registry[stage] if isinstance(stage, str) else stage
    store = store or Store(cfg.store_root)
    tracker = tracker or NullTracker()
    keys = keys or stage_keys(cfg, registry)
    key = keys[stage.name]
    missing = [i for i in stage.inputs if not store.is_complete(i, keys[i])]
    if missing:
        raise KilnError(f"stage {stage.name} needs {', '.join(missing)} first (not complete in {store.root}): "
                        f"run `kiln run --until {missing[-1]}` or the whole pipeline")
    started = time.perf_counter()

    def waiting(owner: dict) -> None:
        log.warning("stage %s/%s is being computed by %s; waiting to reuse it", stage.name, key, lock_holder(owner))

    with store.lock(stage.name, key, timeout_s=cfg.orchestration.lock_timeout_s, on_wait=waiting,
                    job_alive=job_alive) as lock:
        if store.is_complete(stage.name, key):
            manifest = store.manifest(stage.name, key)
            run_id = manifest["mlflow_run_id"]
            if parent_run_id:
                run_id = tracker.start_run(_run_name(stage.name, attempt), parent_id=parent_run_id,
                                           tags={**_tags(stage, key, cfg, flow_run_id, "cached", attempt),
                                                 "kiln.source_run_id": manifest["mlflow_run_id"]})
                tracker.end_run(run_id)
            return StageOutcome(stage.name, key, "cached", time.perf_counter() - started,
                                manifest["stats"].get("headline", {}), str(store.path(stage.name, key)), run_id)
        return _execute(stage, cfg, store, tracker, registry, keys, parent_run_id, flow_run_id, attempt, on_event, lock)


def _execute(stage: Stage, cfg: KilnConfig, store: Store, tracker: Tracker, registry: Registry,
             keys: dict[str, str], parent_run_id: str | None, flow_run_id: str | None, attempt: int,
             on_event: Callable[[str, dict[str, Any]], None] | None, lock: KeyLock | None = None) -> StageOutcome:
    key = keys[stage.name]
    inputs = {i: store.path(i, keys[i]) for i in stage.inputs}
    run_id = tracker.start_run(_run_name(stage.name, attempt), parent_id=parent_run_id,
                               tags=_tags(stage, key, cfg, flow_run_id, "ran", attempt), params=_params(stage, cfg))
    for name, path in inputs.items():
        tracker.log_input(run_id, name, keys[name], path)
    out_dir = store.begin(stage.name, key, resumable=stage.resumable)
    started, cpu = time.perf_counter(), _CpuMeter()
    recorder = StageRecorder(tracker, run_id, stage.name, key, on_event)
    recorder.lock = lock  # the jobs the stage submits are recorded in it
    broken = lock.broken if lock is not None else None
    if broken and broken.get("jobs"):  # a driver that died holding the key: which of its jobs still run
        recorder.earlier_jobs = live_jobs(broken["jobs"])
        if recorder.earlier_jobs:
            log.warning("stage %s/%s: the driver that held it (pid %s on %s) is gone, but Slurm still runs its jobs %s",
                        stage.name, key, broken.get("pid"), broken.get("host"), ", ".join(recorder.earlier_jobs))
    try:
        stats = stage.body(StageContext(cfg, out_dir, inputs, store, recorder))
    except BaseException as error:
        tracker.set_tags(run_id, {"kiln.status": "failed", "kiln.error": str(error)[:5000]})
        tracker.end_run(run_id, failed=True)
        if isinstance(error, Exception):  # not an interrupt: `kiln status` shows why it failed
            store.record_failure(stage.name, key, {"error": type(error).__name__, "message": str(error),
                                                   "retryable": is_retryable(error), "mlflow_run_id": run_id,
                                                   "config": isinstance(error, ConfigError),
                                                   "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if on_event is not None:  # Prefect turns it into an event that automations alert on
            on_event("kiln.stage.failed", {"stage": stage.name, "key": key, "error": f"{type(error).__name__}: {error}"})
        raise
    wall_s = time.perf_counter() - started
    # cpu_s: this process tree's (torchrun's workers and the local executor's ranks among it), plus what
    # it cannot see: a cluster training job's workers (their own records, `jobs_cpu_s`) and a data stage's
    # ranks outside the tree (`executor_cpu_s`; its Slurm jobs' launch records carry none, so neither
    # counts twice). accelerator-seconds: devices held (a training stage's num_accelerators; 0 on CPU) x wall time
    jobs_cpu_s = sum(r["worker_cpu_s"] for r in recorder.launches.values() if r["launcher"] in CLUSTER_LAUNCHERS)
    executor_cpu_s = stats.get("executor_cpu_s", 0.0)
    cost = {"wall_s": wall_s, "cpu_s": cpu.used() + jobs_cpu_s + executor_cpu_s, "jobs_cpu_s": jobs_cpu_s,
            "executor_cpu_s": executor_cpu_s, "peak_rss_mb": _peak_rss_mb(),
            "accelerator_s": stats.get("num_accelerators", 0) * wall_s}
    launch = {"host": socket.gethostname(), "launcher": cfg.cluster.launcher, "executor": cfg.cluster.executor,
              "runs": recorder.launches}
    if recorder.forecasts:
        forecast = stage_forecast(recorder.forecasts)
        stats = {**stats, "forecast": forecast}
        cost.update(priced_forecast(forecast, cost["accelerator_s"]))
    stats = {"headline": {**stage.headline(stats), **cost_headline(cost)}, **stats}
    manifest = {
        "stage": stage.name, "key": key, "format_version": stage.version,
        "inputs": {i: keys[i] for i in stage.inputs}, "identity": stage_identity(stage.name, cfg, registry),
        "stats": stats, "wall_s": wall_s, "cost": cost, "launch": launch, "mlflow_run_id": run_id,
        "prefect_flow_run_id": flow_run_id, "provenance": provenance(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / STATS_FILE).write_text(json.dumps(stats, indent=2, default=str))
    tracker.log_metrics(run_id, {**numeric_stats({k: v for k, v in stats.items() if k != "headline"}),
                                 **{f"cost.{k}": v for k, v in cost.items()}})
    for path in sorted(out_dir.iterdir()):
        if path.suffix in _SMALL_ARTIFACT_SUFFIXES and path.stat().st_size < _SMALL_ARTIFACT_BYTES:
            tracker.log_artifact(run_id, path)
    if recorder.launches:  # the stage's run says where its training ran, all runs together
        tracker.set_tags(run_id, launch_tags(merged_launch(recorder.launches)))
    final = store.commit(stage.name, key, manifest)
    tracker.log_dict(run_id, store.manifest(stage.name, key), "manifest.json")
    tracker.end_run(run_id)
    log.info("stage %s committed to %s in %.1fs", stage.name, final, wall_s)
    return StageOutcome(stage.name, key, "ran", wall_s, stats["headline"], str(final), run_id)


def run_pipeline(cfg: KilnConfig, *, until: str | None = None, registry: Registry | None = None,
                 store: Store | None = None, tracker: Tracker | None = None,
                 parent_run_id: str | None = None) -> list[StageOutcome]:
    """Every pipeline stage in order (up to `until`), without an orchestrator: for notebooks and jobs."""
    registry = registry_or_default(registry)
    keys = stage_keys(cfg, registry)
    return [run_stage(name, cfg, store=store, tracker=tracker, registry=registry, keys=keys,
                      parent_run_id=parent_run_id) for name in stages_until(until, registry)]


def stages_until(until: str | None, registry: Registry) -> list[str]:
    names = list(registry.pipeline())
    if until is None:
        return names
    if until not in names:
        raise KilnError(f"--until {until!r} is not a pipeline stage; stages are: {', '.join(names)}")
    return names[: names.index(until) + 1]
