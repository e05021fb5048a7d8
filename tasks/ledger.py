"""The run ledger: how every run Kiln makes is recorded and resumed, whoever makes it.

A stage run and each run it fans out to (a proxy trial, a transfer run, an ablation branch, the
quality model, a data rank's shard) are kept the same way: a key hashed from what determines the
output (`kiln.tasks.store.stage_key`), a lock per key, a partial folder that a killed attempt leaves
for the next to resume, a manifest written last and an atomic rename, and an MLflow run. The store
(`kiln.tasks.store`) holds the folders; this module holds the bookkeeping around them:

- `StageRecorder`: what a running stage reports through (metrics at a step, health events,
  forecasts, where its work ran) and where its sub-runs come from;
- `SubRun` / `SubRuns`: a declared sub-run and the contract one level down, in
  `{stage folder}/{kind}/{name}/` (or in the store itself, for one several keys share);
- `RankRecords`: the ranks of a data job, which write their shards into one folder they share
  rather than folders of their own: rank i is complete exactly when its record, written last and
  atomically, holds its current key (`rank_key`: the job's settings and the content of what the
  rank reads), whoever ran it and whoever reruns it.

It is the foundation the work layers and the stage runner share, so a work package (the sweep, the
quality model's training) fans out through it without knowing the runner above it. It imports
nothing of Kiln above the foundation.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.keylock import KeyLock
from kiln.tasks.provenance import code_version, provenance
from kiln.tasks.store import Store, stage_key, write_record
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


def subrun_key(kind: str, identity: Mapping[str, Any], inputs: Mapping[str, str], version: int) -> str:
    """A sub-run's key, by the ledger's one scheme (`stage_key`): its kind, its identity, the keys it depends on."""
    return stage_key(kind, dict(identity), dict(inputs), version)


def keyed_subrun(kind: str, identity: Mapping[str, Any], inputs: Mapping[str, str], *,
                 params: Mapping[str, Any] | None = None, version: int = 1) -> SubRun:
    """A sub-run named by its own key: one that several keys of its stage share, stored in the store
    itself (`{kind}/{key}`), found again by whichever run declares the same identity and inputs."""
    return SubRun(kind, subrun_key(kind, identity, inputs, version), identity, params or {}, inputs, version)


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
        self.lock: KeyLock | None = None  # the stage key's lock, held while the stage runs (the runner sets it)
        # Slurm jobs that the stage's previous driver submitted and the scheduler still runs (that driver died
        # holding the key's lock; the runner read them from it): a stage that launches jobs waits for them
        self.earlier_jobs: list[str] = []

    def job_submitted(self, job_id: str) -> None:
        """A Slurm job this stage (or a sub-run of it) submitted: the stage's lock records it, so a waiter,
        `kiln status` and a rerun after this process died know which jobs hold the key's work."""
        if self.parent is not None:
            self.parent.job_submitted(job_id)
        elif self.lock is not None:
            self.lock.add_jobs([job_id])

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

    @contextmanager
    def metrics_behind(self) -> Iterator[Callable[[int, dict[str, float]], None]]:
        """`metrics` that returns at once: the writes go to the tracker from a thread of their own, in order,
        so a training loop never waits on MLflow (a server or database down, or slow, costs the tracker's
        retries before it keeps the writes in its spool). On leaving, every write is made (or spooled);
        a write's error is raised then."""
        pending: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue()
        errors: list[BaseException] = []

        def write() -> None:
            while (item := pending.get()) is not None:
                try:
                    self.metrics(*item)
                except Exception as error:  # the training goes on; its end reports the first one
                    errors.append(error)

        writer = threading.Thread(target=write, name=f"kiln-metrics-{self.stage}", daemon=True)
        writer.start()
        try:
            yield lambda step, metrics: pending.put((step, dict(metrics)))
        finally:
            pending.put(None)
            writer.join()
        if errors:
            raise errors[0]

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


@dataclass(frozen=True)
class OpenSubRun:
    """A begun sub-run that another process finishes (a spawned worker, a launched job): it trains in
    the partial folder (`folder`), and commits it there (`commit`: the manifest, written last, and the
    atomic rename), so the committed sub-run is the record a rerun reuses whichever process made it;
    the stage's process then records the commit on the sub-run's MLflow child run
    (`SubRuns.recorded`). A failed attempt leaves why in the partial folder (`record_failure`).
    JSON-able (`as_json`), for a job's file; picklable, for a worker."""

    root: str  # the sub-runs' store
    kind: str
    name: str
    manifest: dict[str, Any]  # what its stage's process knows at `begin`: key, identity, inputs, child run

    @property
    def store(self) -> Store:
        return Store(self.root)

    @property
    def folder(self) -> Path:
        """The partial folder it runs in."""
        return self.store.partial_path(self.kind, self.name)

    def committed(self) -> dict[str, Any] | None:
        """Its manifest once it is committed for its key, else None."""
        if not self.store.is_complete(self.kind, self.name):
            return None
        manifest = self.store.manifest(self.kind, self.name)
        return manifest if manifest.get("key") == self.manifest["key"] else None

    def commit(self, stats: dict[str, Any], *, wall_s: float, launch: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write its manifest (its stats: what a rerun reuses) and commit the partial folder; returns the manifest."""
        known = dict(self.manifest)
        run_id = known.pop("mlflow_run_id")
        manifest = {**known, "stats": stats, "wall_s": wall_s, "launch": launch or {}, "mlflow_run_id": run_id,
                    "provenance": provenance(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.store.commit(self.kind, self.name, manifest)
        return self.store.manifest(self.kind, self.name)

    def record_failure(self, failure: dict[str, Any]) -> None:
        """Why this attempt failed, kept in the partial folder until the next attempt begins."""
        self.store.record_failure(self.kind, self.name, failure)

    def failure(self) -> dict[str, Any] | None:
        return self.store.failure(self.kind, self.name)

    def as_json(self) -> dict[str, Any]:
        return {"root": self.root, "kind": self.kind, "name": self.name, "manifest": self.manifest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpenSubRun:
        return cls(**data)


class SubRuns:
    """A stage's declared sub-runs under `root`: each in `{root}/{kind}/{name}/`, committed like a stage
    (`Store`: a partial folder, a manifest written last, an atomic rename), each an MLflow child run of
    the stage's run.

    `run` is the whole contract for a sub-run this process trains; a stage that launches its sub-runs
    elsewhere (the sweep's trial jobs) uses its parts: `lock`, `reuse`, `begin` and `opened` (the
    partial folder, where the worker runs and commits), then `recorded` or `fail`. Each sub-run has its
    own lock: one stored in the store itself (the quality model, shared by every clean key that trains
    the same one) may be wanted by two processes at once."""

    def __init__(self, recorder: StageRecorder, root: Path) -> None:
        self.recorder, self.store = recorder, Store(root)

    def key(self, sub: SubRun) -> str:
        inputs = sub.inputs if sub.inputs is not None else {self.recorder.stage: self.recorder.key}
        return subrun_key(sub.kind, sub.identity, inputs, sub.version)

    def path(self, sub: SubRun) -> Path:
        return self.store.path(sub.kind, sub.name)

    def lock(self, sub: SubRun) -> KeyLock:
        """The sub-run's lock: hold it from `reuse` to `recorded` or `fail`."""
        return self.store.lock(sub.kind, sub.name)

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

    def opened(self, sub: SubRun, recorder: StageRecorder) -> OpenSubRun:
        """The begun sub-run (`begin`, its child run `recorder`) as another process finishes and commits it."""
        manifest = {"subrun": f"{sub.kind}/{sub.name}", "stage": self.recorder.stage, "stage_key": self.recorder.key,
                    "key": self.key(sub), "format_version": sub.version, "inputs": dict(sub.inputs or {}),
                    "identity": dict(sub.identity), "mlflow_run_id": recorder.run_id}
        return OpenSubRun(str(self.store.root.resolve()), sub.kind, sub.name, manifest)

    def commit(self, sub: SubRun, recorder: StageRecorder, stats: dict[str, Any], *, wall_s: float,
               failed: bool = False, launch: dict[str, Any] | None = None) -> SubRunOutcome:
        """Write the manifest and commit the partial folder; end the child run (`failed`: a final
        result that is a failure, e.g. a diverged trial, recorded and not run again)."""
        manifest = self.opened(sub, recorder).commit(stats, wall_s=wall_s, launch=launch)
        return self.recorded(sub, recorder, manifest, failed=failed)

    def recorded(self, sub: SubRun, recorder: StageRecorder, manifest: dict[str, Any], *,
                 failed: bool = False) -> SubRunOutcome:
        """Record a committed sub-run (its `manifest`) on its child run: its stats as metrics, the
        manifest as an artifact; end the child run (`failed`: see `commit`)."""
        tracker = recorder.tracker
        tracker.log_metrics(recorder.run_id, {**numeric_stats(manifest["stats"]), "wall_s": manifest["wall_s"]})
        tracker.log_dict(recorder.run_id, manifest, "manifest.json")
        tracker.end_run(recorder.run_id, failed=failed)
        return SubRunOutcome(f"{sub.kind}/{sub.name}", manifest["key"], "ran", manifest["stats"], self.path(sub),
                             recorder.run_id, manifest)

    def fail(self, recorder: StageRecorder, error: str) -> None:
        """The sub-run did not finish: its child run is marked failed with why; its partial folder stays,
        so the next attempt resumes it."""
        recorder.tracker.set_tags(recorder.run_id, {"kiln.status": "failed", "kiln.error": error[:5000]})
        recorder.tracker.end_run(recorder.run_id, failed=True)

    def run(self, sub: SubRun, body: Callable[[Path, StageRecorder], dict[str, Any]]) -> SubRunOutcome:
        """Reuse the complete sub-run, or run `body(partial folder, recorder)` in this process (resuming
        what an earlier attempt left there) and commit what it returns as the sub-run's stats. Under the
        sub-run's own lock, for one stored where other keys of its stage (other processes) want it too."""
        with self.lock(sub):
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




RANK_FORMAT = 1  # the format of a rank's record and key


def rank_key(job: str, identity: Any, inputs: Mapping[str, str]) -> str:
    """A data rank's key, by the ledger's one scheme (`stage_key`): its job, the settings its ranks
    compute with (`identity`, JSON-able), and the content (sha256) of each file it reads, by name."""
    return stage_key(job, identity, dict(inputs), RANK_FORMAT)


class RankRecords:
    """The completion records of a job's ranks, `{folder}/NNNNN.json`. A rank writes its record last,
    after its outputs, atomically (`write_record`): a rank killed before that has none and runs again;
    one whose key changed since (its input's content, the job's settings) runs again too."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def path(self, rank: int) -> Path:
        return self.folder / f"{rank:05d}.json"

    def get(self, rank: int, key: str) -> dict[str, Any] | None:
        """Rank `rank`'s record if it finished under `key`, else None."""
        try:
            record = json.loads(self.path(rank).read_text())
        except FileNotFoundError:
            return None
        return record if record.get("key") == key else None

    def put(self, rank: int, key: str, record: Mapping[str, Any]) -> None:
        """Record that `rank` finished under `key` (its outputs written)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        write_record(self.path(rank), {"key": key, **record})

    def stale(self, keys: Sequence[str]) -> list[int]:
        """The recorded ranks whose record is not for their key in `keys` (or that `keys` has no rank for)."""
        recorded = sorted(int(path.stem) for path in self.folder.glob("[0-9]*.json")) if self.folder.is_dir() else []
        return [rank for rank in recorded if rank >= len(keys) or self.get(rank, keys[rank]) is None]

    def discard(self, rank: int) -> None:
        self.path(rank).unlink(missing_ok=True)
