"""MLflow tracking for Kiln: the only module that imports mlflow.

One run per stage run (a child of the pipeline's run), one grandchild per proxy run. Runs are
addressed by id through `MlflowClient` rather than MLflow's thread-local "active run", so
Prefect may run stages in any thread without runs leaking into each other. `MlflowTracker`
implements `tasks.tracker.Tracker`, the protocol the stage runner records through.

Recording never fails a stage for MLflow's sake nor loses a record: a write that hit a database
lock is retried (`tracking.write_retry_s`), and one MLflow still cannot take is kept in the store's
spool (`tasks.tracking_spool`) and written when MLflow answers again, by this run or the next.

Metric and param names are sanitised here, in one place (`metric_name`): stats keys carry
free-form strings (licences such as `BSD-4-Clause-UC (fortune-mod; collected quotations)`) that
MLflow rejects as names. A name that had to change gets a short hash of the raw key, so two raw
keys never merge into one metric; the raw keys stay in the stage's `stats.json` artifact, and each
run's renamed metrics are listed in its `metric_names.json` artifact.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import re
import time
import urllib.request
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kiln.tasks.tracking_spool import LOCAL_PREFIX, Refused, Replayed, Spool, local_run_id, spool_dir

_MAX_PARAM_VALUE = 6000
_BATCH = 1000
_MAX_NAME = 250
# MLflow's own rule on POSIX (`[/\w.\- :]`), in ASCII; `:` keeps reasons such as `language:ja` readable.
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_\-. /:]")
_HASH_CHARS = 8
METRIC_NAMES_ARTIFACT = "metric_names.json"
_DOWN_FOR_S = 15.0  # after MLflow could not take a write: journal without trying it, then look again

log = logging.getLogger(__name__)


class _RetriedLocks(logging.Filter):
    """MLflow logs each `database is locked` with its traceback before raising it; Kiln retries those
    writes and says so itself if it gives up (`_went_down`), so the tracebacks are noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "database is locked" not in record.getMessage()


logging.getLogger("mlflow.store.db.utils").addFilter(_RetriedLocks())


def metric_name(key: str) -> str:
    """`key` as a name MLflow accepts: at most 250 of `A-Za-z0-9_-. /:`, and a path MLflow deems
    unique (no empty, `.` or `..` segment, no leading `.` or `/`). Unchanged if already valid;
    otherwise sanitised and suffixed with a hash of `key`, so distinct keys stay distinct."""
    segments = [segment if segment not in ("", ".", "..") else "_" for segment in _UNSAFE_NAME.sub("_", key).split("/")]
    name = "/".join(segments)
    if name.startswith("."):
        name = "_" + name
    if name == key and len(name) <= _MAX_NAME:
        return name
    digest = hashlib.blake2b(key.encode("utf-8", errors="surrogatepass"), digest_size=_HASH_CHARS // 2).hexdigest()
    return f"{name[:_MAX_NAME - _HASH_CHARS - 1].rstrip('/')}_{digest}"


@contextmanager
def _first_use_lock(uri: str):
    """Serialise opening an SQLite tracking database: two processes creating its schema at once fail
    (`index ... already exists`)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".init.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → `a.b.c: value` strings (lists as JSON), as MLflow params."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            flat[metric_name(name)] = text[:_MAX_PARAM_VALUE]
    return flat


_TRACKERS: dict[tuple[str, str, Path | None, Path | None, float], MlflowTracker] = {}


def _locked(error: BaseException) -> bool:
    """A write a local store's database refused for now (SQLite `database is locked`, a lost connection):
    MLflow raises TEMPORARILY_UNAVAILABLE and does not retry it itself."""
    return isinstance(error, MlflowException) and error.error_code == "TEMPORARILY_UNAVAILABLE"


def _unreachable(error: BaseException) -> bool:
    """MLflow could not take a write now: a lock that outlasted Kiln's retries, or a server that did not
    answer through MLflow's own client retries (~4 min of them: `API request to ... failed`)."""
    return (_locked(error) or isinstance(error, (OSError, requests.RequestException))
            or (isinstance(error, MlflowException) and str(error).startswith("API request to")))


def _now_ms() -> int:
    return int(time.time() * 1000)


class MlflowTracker:
    """Creates and records runs in one MLflow experiment at `uri`.

    Every write that hits a lock is retried for up to `write_retry_s`; with a `spool` folder, a write
    MLflow still cannot take is journaled there (`tasks.tracking_spool`) and written once MLflow
    answers, so that recording never fails a stage nor loses a record. While MLflow is known to be
    unreachable, writes go straight to the journal (each would wait out MLflow's client retries)."""

    def __init__(self, uri: str, experiment: str, artifact_root: Path | None = None, spool: Path | None = None,
                 write_retry_s: float = 60.0):
        self.uri = uri
        self.write_retry_s = write_retry_s
        with _first_use_lock(uri):
            self.client = MlflowClient(tracking_uri=uri)
            self._renamed: dict[str, dict[str, str]] = {}  # run id → sanitised metric name → raw key
            found = self._with_retries(lambda: self.client.get_experiment_by_name(experiment))
            if found is None:
                location = artifact_root.resolve().as_uri() if artifact_root else None
                self.experiment_id = self._with_retries(
                    lambda: self.client.create_experiment(experiment, artifact_location=location))
            else:
                self.experiment_id = found.experiment_id
        self.spool = Spool(spool, uri, experiment) if spool is not None else None
        self._down_until = 0.0  # until then, writes are journaled without trying MLflow

    @classmethod
    def shared(cls, uri: str, experiment: str, *, work_dir: Path, store_root: Path,
               write_retry_s: float = 60.0) -> MlflowTracker:
        """The tracker of this store and experiment, made once per process (a client costs ~0.1 s); when
        made, it writes what earlier runs kept in the store's spool because MLflow could not take it."""
        # a tracking server keeps artifacts where it was told to (`kiln up`: work_dir/servers/mlartifacts)
        local = not uri.startswith(("http://", "https://"))
        artifact_root = (work_dir / "mlartifacts").resolve() if local else None
        spool = spool_dir(store_root).resolve()
        key = (uri, experiment, artifact_root, spool, write_retry_s)
        if key not in _TRACKERS:
            _TRACKERS[key] = cls(uri, experiment, artifact_root, spool, write_retry_s)
            _TRACKERS[key].replay()
        return _TRACKERS[key]

    # --- writes: retried, journaled when MLflow cannot take them --------------------------------------
    def _with_retries(self, call: Callable[[], Any]) -> Any:
        deadline, delay = time.monotonic() + self.write_retry_s, 0.5
        while True:
            try:
                return call()
            except MlflowException as error:
                if not _locked(error) or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 8.0)

    def _apply(self, op: str, run_id: str | None, payload: dict[str, Any]) -> str | None:
        """One write, as journaled: the create_run op returns the new run's id."""
        if op == "create_run":
            return self.client.create_run(self.experiment_id, start_time=payload["start_time"], tags=payload["tags"],
                                          run_name=payload["name"]).info.run_id
        if op == "log_batch":
            self.client.log_batch(run_id, metrics=[Metric(*m) for m in payload.get("metrics", [])],
                                  params=[Param(k, v) for k, v in payload.get("params", {}).items()],
                                  tags=[RunTag(k, v) for k, v in payload.get("tags", {}).items()])
        elif op == "set_terminated":
            self.client.set_terminated(run_id, payload["status"], end_time=payload["end_time"])
        elif op == "log_input":
            with warnings.catch_warnings():
                # MLflow registers its local-artifact source twice and warns that a file URI matches both.
                warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
                source = resolve_dataset_source(payload["uri"])
            dataset = MetaDataset(source=source, name=payload["name"], digest=payload["digest"])
            entry = DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", payload["context"])])
            self.client.log_inputs(run_id, datasets=[entry])
        elif op == "log_artifact":
            path = Path(payload["path"])
            if path.is_dir():
                self.client.log_artifacts(run_id, str(path), payload["artifact_path"])
            elif path.is_file():
                self.client.log_artifact(run_id, str(path), payload["artifact_path"])
        elif op == "log_dict":
            self.client.log_dict(run_id, payload["data"], payload["artifact_file"])
        else:
            raise AssertionError(f"unknown tracking write {op!r}")
        return None

    def _write(self, run_id: str | None, op: str, payload: dict[str, Any]) -> str | None:
        """`op` on `run_id` now, or journaled after the run's earlier journaled writes; the create_run op
        returns the run's id, a local one when journaled."""
        spool = self.spool
        if spool is None:
            return self._with_retries(lambda: self._apply(op, run_id, payload))
        run_id = spool.resolve(run_id)
        waits_on = run_id  # the run whose journaled writes this one must follow: its own, or its parent's
        if op == "create_run" and "mlflow.parentRunId" in payload["tags"]:
            waits_on = spool.resolve(payload["tags"]["mlflow.parentRunId"])
            payload = {**payload, "tags": {**payload["tags"], "mlflow.parentRunId": waits_on}}
        if waits_on is not None and spool.journaled(waits_on):
            self._catch_up()
        behind = waits_on is not None and (waits_on.startswith(LOCAL_PREFIX) or spool.journaled(waits_on))
        if behind or time.monotonic() < self._down_until:
            return self._journal(run_id, op, payload)
        try:
            written = self._with_retries(lambda: self._apply(op, run_id, payload))
        except Exception as error:
            if not _unreachable(error):
                raise
            self._went_down(error)
            return self._journal(run_id, op, payload)
        if spool.has_mine():  # MLflow answers again: this process's journals go in now
            self._catch_up()
        return written

    def _journal(self, run_id: str | None, op: str, payload: dict[str, Any]) -> str:
        if op == "create_run":
            run_id = local_run_id()
        self.spool.append(run_id, op, payload)
        return run_id

    def _went_down(self, error: BaseException) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("MLflow at %s could not take a write (%s: %s); Kiln keeps the records in %s and writes them "
                        "when MLflow answers again (this run, or the next)", self.uri, type(error).__name__,
                        (str(error).splitlines() or [""])[0][:300], self.spool.folder)
        self._down_until = time.monotonic() + _DOWN_FOR_S

    def _answers(self) -> bool:
        """A cheap look before replaying: a server's health page (a database store: try the replay)."""
        if not self.uri.startswith(("http://", "https://")):
            return True
        try:
            with urllib.request.urlopen(self.uri.rstrip("/") + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _catch_up(self) -> None:
        """Write this process's journals if MLflow answers again (at most every few seconds while it does not)."""
        if time.monotonic() < self._down_until:
            return
        if not self._answers():
            self._down_until = time.monotonic() + _DOWN_FOR_S
            return
        self._replay(mine_only=True)

    def replay(self) -> Replayed:
        """Write every journal in the spool this process may (see `tasks.tracking_spool`), and say so."""
        if self.spool is None or not self.spool.pending():
            return Replayed()
        return self._replay(mine_only=False)

    def _replay(self, mine_only: bool) -> Replayed:
        def apply(op: str, run_id: str | None, payload: dict[str, Any]) -> str | None:
            try:
                return self._with_retries(lambda: self._apply(op, run_id, payload))
            except MlflowException as error:
                if _unreachable(error):
                    raise
                raise Refused(f"{error.error_code}: {error}") from error

        try:
            done = self.spool.replay(apply, mine_only=mine_only)
        except Exception as error:
            if not _unreachable(error):
                raise
            self._went_down(error)
            return Replayed(left=[p.name for p in self.spool.pending()])
        if done.writes:
            log.warning("wrote %d records (%d runs created) that MLflow at %s could not take earlier, from %s",
                        done.writes, done.runs, self.uri, self.spool.folder)
        if done.refused:
            log.error("MLflow at %s refused the records of %d runs; they are kept in %s: %s", self.uri,
                      len(done.refused), self.spool.folder / "refused", ", ".join(done.refused))
        return done

    # --- the Tracker protocol ------------------------------------------------------------------------
    def start_run(self, name: str, *, parent_id: str | None = None, tags: Mapping[str, Any] | None = None,
                  params: Mapping[str, Any] | None = None) -> str:
        run_tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent_id:
            run_tags["mlflow.parentRunId"] = parent_id
        run_id = self._write(None, "create_run", {"name": name, "tags": run_tags, "start_time": _now_ms()})
        if params:
            self.log_params(run_id, params)
        return run_id

    def find_run(self, tags: Mapping[str, str]) -> str | None:
        """The newest run in this experiment carrying all `tags`: how a recurring flow finds its run again."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=query,
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def metric_steps(self, run_id: str, key: str) -> set[int]:
        """The steps at which metric `key` has been logged in the run."""
        return {m.step for m in self.client.get_metric_history(run_id, metric_name(key.replace("/", ".")))}

    def end_run(self, run_id: str, *, failed: bool = False) -> None:
        self._write(run_id, "set_terminated", {"status": "FAILED" if failed else "FINISHED", "end_time": _now_ms()})

    def reopen_run(self, run_id: str, name: str | None = None, clear_tags: tuple[str, ...] = ()) -> None:
        """Mark an ended run running again, renamed to `name` if given and without `clear_tags` (what its
        previous end recorded): a retried Prefect flow run continues its MLflow run."""
        tags = self.client.get_run(run_id).data.tags
        for tag in clear_tags:
            if tag in tags:
                self.client.delete_tag(run_id, tag)
        self.client.update_run(run_id, status="RUNNING", name=name)

    def running_runs(self) -> list[tuple[str, dict[str, str]]]:
        """Every run of this experiment still RUNNING, with its tags (`tasks.crashes` finds the dead ones)."""
        runs = self.client.search_runs([self.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                       max_results=5000)
        return [(run.info.run_id, dict(run.data.tags)) for run in runs]

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = list(flatten(params).items())
        for start in range(0, len(items), 100):
            self._write(run_id, "log_batch", {"params": dict(items[start:start + 100])})

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self._write(run_id, "log_batch", {"tags": {k: str(v) for k, v in tags.items()}})

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        now = _now_ms()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        names = {k: metric_name(k.replace("/", ".")) for k in numeric}
        # keyed by name: `a/b` and `a.b` (nested stats) are one metric, not one batch's duplicates
        values = {names[k]: value for k, value in numeric.items()}
        items = [[name, value, now, step or 0] for name, value in values.items()]
        for start in range(0, len(items), _BATCH):
            self._write(run_id, "log_batch", {"metrics": items[start:start + _BATCH]})
        renamed = {name: k for k, name in names.items() if name != k.replace("/", ".")}
        known = self._renamed.setdefault(run_id, {})
        if not renamed.keys() <= known.keys():  # the raw keys of renamed metrics, as an artifact
            known.update(renamed)
            self.log_dict(run_id, dict(sorted(known.items())), METRIC_NAMES_ARTIFACT)

    def log_input(self, run_id: str, name: str, digest: str, uri: Path, context: str = "input") -> None:
        """Record a stage input as an MLflow dataset whose digest is the input stage's key."""
        self._write(run_id, "log_input", {"name": name, "digest": digest, "uri": uri.resolve().as_uri(),
                                          "context": context})

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        if path.exists():
            self._write(run_id, "log_artifact", {"path": str(path), "artifact_path": artifact_path})

    def log_dict(self, run_id: str, data: dict[str, Any], artifact_file: str) -> None:
        self._write(run_id, "log_dict", {"data": data, "artifact_file": artifact_file})
