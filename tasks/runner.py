"""The stage contract in plain Python: lock the key → reuse it if complete, else begin the partial
folder → run the body → write the manifest → commit → record.

Prefect tasks, the CLI, a Slurm job and a notebook all call `run_stage`, so each gets the same
manifest, commit and tracking; the Prefect wrapper (`flows/stages.py`) adds only caching,
retries and artifacts. Two callers that want one key at the same time (two runs, two machines)
are serialised by the key's lock: the second waits, then reuses what the first committed.

A stage that fans out (proxy trials, transfer runs, ablation branches, the quality model) runs
each declared `SubRun` through `SubRuns`: the same contract one level down, in the stage's own
partial folder — `{stage folder}/{kind}/{name}/` with its own key, manifest (stats, provenance,
where it was launched) and MLflow child run. A sub-run found complete is reused, one whose
partial folder a crashed or killed attempt left is resumed from it, so a retried stage redoes
only the sub-runs that did not finish. This is the one resume mechanism: no stage keeps a
private log of what it finished.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel

from kiln.tasks.config import KilnConfig
from kiln.tasks.configbase import Section, is_runtime
from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.errors import KilnError, is_retryable
from kiln.tasks.graph import config_value, stage_identity, stage_keys
from kiln.tasks.provenance import code_version, provenance
from kiln.tasks.stage import STATS_FILE, Registry, Stage, StageContext, SubRun
from kiln.tasks.store import MANIFEST_FILE, Store, stage_key
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


class StageRecorder:
    """What a stage body reports through while it runs: metrics at a step, health events, forecasts, and
    its sub-runs (`subruns`). A sub-run's recorder is one of these too, on the sub-run's child run;
    its forecasts join its stage's, named `{kind}/{name}`."""

    def __init__(self, tracker: Tracker, run_id: str, stage: str, key: str,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None, *,
                 parent: StageRecorder | None = None, name: str | None = None) -> None:
        self.tracker, self.run_id, self.stage, self.key = tracker, run_id, stage, key
        self._on_event = on_event
        self.parent, self.name = parent, name
        self.forecasts: dict[str, dict[str, Any]] = {}
        self.launches: dict[str, dict[str, Any]] = {}  # run name -> where it ran (`launched`)

    def launched(self, record: dict[str, Any], run: str | None = None) -> None:
        """Where one training run of this stage ran (`tasks.launch.launched_training.launch_record`):
        tags on this run (`kiln.launcher`, `kiln.job_ids`, `kiln.nodes`, `kiln.job_name`), and the
        stage's manifest's `launch.runs`, named `run` (a sub-run's under its `{kind}/{name}`)."""
        self.tracker.set_tags(self.run_id, launch_tags(record))
        if self.parent is not None:
            self.parent.launched(record, run or self.name)
            return
        self.launches[run or self.stage] = record

    def record_forecast(self, forecast: dict[str, Any], run: str | None = None) -> None:
        """The planner's forecast of one training run of this stage (`tasks.train.planner.forecast_record`),
        named `run` (the stage's name by default): the runner records their sum (`stage_forecast`) beside
        the measured cost, in stats, manifest and MLflow."""
        if self.parent is not None:  # a sub-run's training is its stage's
            self.parent.record_forecast(forecast, run or self.name)
            return
        self.forecasts[run or self.stage] = forecast

    def job_launched(self, record: dict[str, Any]) -> None:
        """`launched` for a data pipeline's executor job, named after the job (a stage may run several)."""
        self.launched(record, record["job_name"])

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(self.run_id, metrics, step)

    def used(self, settings: dict[str, Any], run: str | None = None) -> None:
        """The settings a training run of this stage used (where the config says `plan`, the plan's), as
        params `used.<setting>` (`<run>/used.<setting>` for a stage's further runs): the config's params
        say what was asked for, these what ran."""
        self.tracker.log_params(self.run_id, {f"{run}/used" if run else "used": settings})

    def event(self, event: dict[str, Any]) -> None:
        """A training health event (rollback, abort, relaunch): a tag and metric here, and the caller's
        `on_event` (the Prefect flows emit it as an event that automations can alert on)."""
        self.tracker.set_tags(self.run_id, {f"kiln.health.step_{event['step']}": f"{event['kind']}: {event.get('action')}"})
        loss = event.get("loss")
        self.tracker.log_metrics(self.run_id, {"health.event_loss": loss if isinstance(loss, (int, float)) else float("nan")},
                                 event["step"])
        if self._on_event is not None:
            self._on_event(f"kiln.train.{event.get('action', 'event')}", event)

    def subruns(self, root: Path) -> SubRuns:
        """The sub-runs of this stage, in `root` (the stage's folder, or the store for one shared by keys)."""
        return SubRuns(self, root)


@dataclass(frozen=True)
class SubRunOutcome:
    name: str  # "{kind}/{name}"
    key: str
    status: str  # "ran" or "cached"
    stats: dict[str, Any]
    path: Path
    mlflow_run_id: str
    manifest: dict[str, Any]


class SubRuns:
    """A stage's declared sub-runs under `root`: each in `{root}/{kind}/{name}/`, committed like a stage
    (`Store`: a partial folder, a manifest written last, an atomic rename), each an MLflow child run of
    the stage's run.

    `run` is the whole contract for a sub-run this process trains; a stage that launches its sub-runs
    elsewhere (the sweep's trial jobs) uses its parts: `reuse`, `begin` (the partial folder, where the
    job writes), then `commit` or `fail`. The stage's key lock covers them: they live in its folder.
    `run` also takes the sub-run's own lock: a sub-run stored in the store itself (the quality model,
    shared by every clean key that trains the same one) may be wanted by two processes at once."""

    def __init__(self, recorder: StageRecorder, root: Path) -> None:
        self.recorder, self.store = recorder, Store(root)

    def key(self, sub: SubRun) -> str:
        inputs = dict(sub.inputs) if sub.inputs is not None else {self.recorder.stage: self.recorder.key}
        return stage_key(sub.kind, dict(sub.identity), inputs, sub.version)

    def path(self, sub: SubRun) -> Path:
        return self.store.path(sub.kind, sub.name)

    def manifest(self, sub: SubRun) -> dict[str, Any] | None:
        """The sub-run's manifest when it is complete for its current key, else None."""
        if not self.store.is_complete(sub.kind, sub.name):
            return None
        manifest = self.store.manifest(sub.kind, sub.name)
        return manifest if manifest.get("key") == self.key(sub) else None

    def reuse(self, sub: SubRun) -> SubRunOutcome | None:
        """The complete sub-run, recorded as a cached child run pointing at the run that made it; None
        when it must (still) run."""
        manifest = self.manifest(sub)
        if manifest is None:
            return None
        run_id = self.recorder.tracker.start_run(
            sub.name, parent_id=self.recorder.run_id, params=dict(sub.params),
            tags={**self._tags(sub, "cached"), "kiln.source_run_id": manifest["mlflow_run_id"]})
        self.recorder.tracker.end_run(run_id)
        return SubRunOutcome(f"{sub.kind}/{sub.name}", manifest["key"], "cached", manifest["stats"], self.path(sub),
                             run_id, manifest)

    def begin(self, sub: SubRun) -> tuple[Path, StageRecorder]:
        """The sub-run's partial folder (a killed attempt's, kept: training resumes from its checkpoints)
        and the recorder of its child run, started now."""
        folder = self.store.begin(sub.kind, sub.name, resumable=True)
        run_id = self.recorder.tracker.start_run(sub.name, parent_id=self.recorder.run_id,
                                                 tags=self._tags(sub, "ran"), params=dict(sub.params))
        parent = self.recorder
        return folder, StageRecorder(parent.tracker, run_id, parent.stage, parent.key, parent._on_event,
                                     parent=parent, name=f"{sub.kind}/{sub.name}")

    def commit(self, sub: SubRun, recorder: StageRecorder, stats: dict[str, Any], *, wall_s: float,
               failed: bool = False, launch: dict[str, Any] | None = None) -> SubRunOutcome:
        """Write the manifest and commit the partial folder; end the child run (`failed`: a final
        result that is a failure, e.g. a diverged trial, recorded and not run again)."""
        key = self.key(sub)
        manifest = {"subrun": f"{sub.kind}/{sub.name}", "stage": self.recorder.stage, "stage_key": self.recorder.key,
                    "key": key, "format_version": sub.version, "inputs": dict(sub.inputs or {}),
                    "identity": dict(sub.identity), "stats": stats, "wall_s": wall_s, "launch": launch or {},
                    "mlflow_run_id": recorder.run_id, "provenance": provenance(),
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tracker = recorder.tracker
        tracker.log_metrics(recorder.run_id, {**_numeric(stats), "wall_s": wall_s})
        final = self.store.commit(sub.kind, sub.name, manifest)
        tracker.log_dict(recorder.run_id, json.loads((final / MANIFEST_FILE).read_text()), "manifest.json")
        tracker.end_run(recorder.run_id, failed=failed)
        return SubRunOutcome(f"{sub.kind}/{sub.name}", key, "ran", stats, final, recorder.run_id, manifest)

    def fail(self, recorder: StageRecorder, error: str) -> None:
        """The sub-run did not finish: its child run is marked failed with why; its partial folder stays,
        so the next attempt resumes it."""
        recorder.tracker.set_tags(recorder.run_id, {"kiln.status": "failed", "kiln.error": error[:5000]})
        recorder.tracker.end_run(recorder.run_id, failed=True)

    def run(self, sub: SubRun, body: Callable[[Path, StageRecorder], dict[str, Any]]) -> SubRunOutcome:
        """Reuse the complete sub-run, or run `body(partial folder, recorder)` in this process (resuming
        what an earlier attempt left there) and commit what it returns as the sub-run's stats. Under the
        sub-run's own lock, for one stored where other keys of its stage (other processes) want it too."""
        with self.store.lock(sub.kind, sub.name):
            reused = self.reuse(sub)
            if reused is not None:
                return reused
            folder, recorder = self.begin(sub)
            started = time.perf_counter()
            try:
                stats = body(folder, recorder)
            except BaseException as error:
                self.fail(recorder, f"{type(error).__name__}: {error}")
                raise
            return self.commit(sub, recorder, stats, wall_s=time.perf_counter() - started)

    def _tags(self, sub: SubRun, status: str) -> dict[str, str]:
        code = code_version()
        # the owner: a crash that leaves the child run RUNNING is marked like its stage's (tasks.crashes)
        return {"kiln.stage": self.recorder.stage, "kiln.key": self.recorder.key, "kiln.subrun": sub.kind,
                "kiln.subrun_key": self.key(sub), "kiln.status": status, "kiln.git_sha": code["git_sha"],
                OWNER_TAG: process_owner()}


def merged_launch(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Several runs' launch records as one: their launchers, job ids, nodes and attempts together."""
    records = list(runs.values())
    return {"launcher": ",".join(sorted({r["launcher"] for r in records})),
            "job_name": ",".join(sorted({r["job_name"] for r in records if r.get("job_name")})),
            "job_ids": [j for r in records for j in r["job_ids"]],
            "nodes": sorted({n for r in records for n in r["nodes"]}),
            "attempts": [a for r in records for a in r["attempts"]]}


def launch_tags(record: dict[str, Any]) -> dict[str, str]:
    """A launch record (`StageRecorder.launched`) as MLflow tags."""
    return {"kiln.launcher": record["launcher"], "kiln.job_name": record.get("job_name") or "",
            "kiln.job_ids": ",".join(record["job_ids"]), "kiln.nodes": ",".join(record["nodes"]),
            "kiln.attempts": str(len(record["attempts"]))}


def _numeric(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update(_numeric(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = value
    return flat


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
    if registry is None:
        from kiln.tasks.stages import REGISTRY as registry
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
        log.warning("stage %s/%s is being computed by %s (pid %s); waiting to reuse it",
                    stage.name, key, owner.get("host"), owner.get("pid"))

    with store.lock(stage.name, key, timeout_s=cfg.orchestration.lock_timeout_s, on_wait=waiting):
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
        return _execute(stage, cfg, store, tracker, registry, keys, parent_run_id, flow_run_id, attempt, on_event)


def _execute(stage: Stage, cfg: KilnConfig, store: Store, tracker: Tracker, registry: Registry,
             keys: dict[str, str], parent_run_id: str | None, flow_run_id: str | None, attempt: int,
             on_event: Callable[[str, dict[str, Any]], None] | None) -> StageOutcome:
    key = keys[stage.name]
    inputs = {i: store.path(i, keys[i]) for i in stage.inputs}
    run_id = tracker.start_run(_run_name(stage.name, attempt), parent_id=parent_run_id,
                               tags=_tags(stage, key, cfg, flow_run_id, "ran", attempt), params=_params(stage, cfg))
    for name, path in inputs.items():
        tracker.log_input(run_id, name, keys[name], path)
    out_dir = store.begin(stage.name, key, resumable=stage.resumable)
    started, cpu = time.perf_counter(), _CpuMeter()
    recorder = StageRecorder(tracker, run_id, stage.name, key, on_event)
    try:
        stats = stage.body(StageContext(cfg, out_dir, inputs, store, recorder))
    except BaseException as error:
        tracker.set_tags(run_id, {"kiln.status": "failed", "kiln.error": str(error)[:5000]})
        tracker.end_run(run_id, failed=True)
        if isinstance(error, Exception):  # not an interrupt: `kiln status` shows why it failed
            store.record_failure(stage.name, key, {"error": type(error).__name__, "message": str(error),
                                                   "retryable": is_retryable(error), "mlflow_run_id": run_id,
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
    tracker.log_metrics(run_id, {**_numeric({k: v for k, v in stats.items() if k != "headline"}),
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
    if registry is None:
        from kiln.tasks.stages import REGISTRY as registry
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
