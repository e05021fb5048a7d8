"""The run ledger: how every run Kiln makes is recorded and resumed, whoever makes it.

A stage run and each run it fans out to (a proxy trial, a transfer run, an ablation branch, the
quality model, a data rank's shard) are kept the same way: a key hashed from what determines the
output (`kiln.tasks.store.stage_key`), a lock per key, a partial folder that a killed attempt leaves
for the next to resume, a manifest written last and an atomic rename, and an MLflow run. The store
(`kiln.tasks.store`) holds the folders; this module holds the bookkeeping around them:

- `StageRecorder`: what a running stage reports through (metrics at a step, health events,
  forecasts, where its work ran) and where its sub-runs come from;
- `SubRun` / `SubRuns`: a declared sub-run and the contract one level down, in
  `{stage folder}/{kind}/{name}/` (or in the store itself, for one several keys share).

It is the foundation the work layers and the stage runner share, so a work package (the sweep, the
quality model's training) fans out through it without knowing the runner above it. It imports
nothing of Kiln above the foundation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.provenance import code_version, provenance
from kiln.tasks.store import MANIFEST_FILE, Store, stage_key
from kiln.tasks.tracker import Tracker


@dataclass(frozen=True)
class SubRun:
    """One run a stage fans out to, declared: where it lives (`{kind}/{name}` under its stage's folder),
    what its key hashes (`identity`, `inputs` — by default its stage's key —, `version`) and what its
    MLflow child run shows (`params`). Named for a person (a trial by its hyper-parameters); keyed by
    its content, so a sub-run whose declaration changed is not reused under its old name."""

    kind: str  # "trials", "transfer", "branches", "quality_model": its folder
    name: str  # a plain file name, unique within its kind
    identity: Mapping[str, Any]
    params: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, str] | None = None  # the keys it depends on; None: its stage's key
    version: int = 1


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
        """Where one training run of this stage ran (`tasks.train.launched_training.launch_record`):
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
        tracker.log_metrics(recorder.run_id, {**numeric_stats(stats), "wall_s": wall_s})
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


def numeric_stats(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers in `stats`, flattened to dotted names (what MLflow takes as metrics)."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update(numeric_stats(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = value
    return flat


