"""MLflow tracking for Kiln: the only module that imports mlflow.

One run per stage run (a child of the pipeline's run), one grandchild per proxy run. Runs are
addressed by id through `MlflowClient` rather than MLflow's thread-local "active run", so
Prefect may run stages in any thread without runs leaking into each other. `MlflowTracker`
implements `tasks.tracker.Tracker`, the protocol the stage runner records through.

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
import re
import time
import warnings
from contextlib import contextmanager
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

if TYPE_CHECKING:
    from tasks.config import KilnConfig

_MAX_PARAM_VALUE = 6000
_BATCH = 1000
_MAX_NAME = 250
# MLflow's own rule on POSIX (`[/\w.\- :]`), in ASCII; `:` keeps reasons such as `language:ja` readable.
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_\-. /:]")
_HASH_CHARS = 8
METRIC_NAMES_ARTIFACT = "metric_names.json"


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


_TRACKERS: dict[tuple[str, str, Path | None], MlflowTracker] = {}


class MlflowTracker:
    """Creates and records runs in one MLflow experiment at `uri`."""

    def __init__(self, uri: str, experiment: str, artifact_root: Path | None = None):
        self.uri = uri
        with _first_use_lock(uri):
            self.client = MlflowClient(tracking_uri=uri)
            self._renamed: dict[str, dict[str, str]] = {}  # run id → sanitised metric name → raw key
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = artifact_root.resolve().as_uri() if artifact_root else None
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
            else:
                self.experiment_id = found.experiment_id

    @classmethod
    def for_config(cls, cfg: KilnConfig) -> MlflowTracker:
        """The tracker of `cfg`'s store and experiment, made once per process (a client costs ~0.1 s)."""
        uri = cfg.tracking_uri
        # a tracking server keeps artifacts where it was told to (`kiln up`: work_dir/servers/mlartifacts)
        local = not uri.startswith(("http://", "https://"))
        artifact_root = (Path(cfg.work_dir) / "mlartifacts").resolve() if local else None
        key = (uri, cfg.tracking.experiment, artifact_root)
        if key not in _TRACKERS:
            _TRACKERS[key] = cls(uri, cfg.tracking.experiment, artifact_root)
        return _TRACKERS[key]

    def start_run(self, name: str, *, parent_id: str | None = None, tags: Mapping[str, Any] | None = None,
                  params: Mapping[str, Any] | None = None) -> str:
        run_tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent_id:
            run_tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=run_tags)
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

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
        self.client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

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
        items = [Param(k, v) for k, v in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start:start + 100])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        names = {k: metric_name(k.replace("/", ".")) for k in numeric}
        # keyed by name: `a/b` and `a.b` (nested stats) are one metric, not one batch's duplicates
        values = {names[k]: value for k, value in numeric.items()}
        items = [Metric(name, value, now, step or 0) for name, value in values.items()]
        for start in range(0, len(items), _BATCH):
            self.client.log_batch(run_id, metrics=items[start:start + _BATCH])
        renamed = {name: k for k, name in names.items() if name != k.replace("/", ".")}
        known = self._renamed.setdefault(run_id, {})
        if not renamed.keys() <= known.keys():  # the raw keys of renamed metrics, as an artifact
            known.update(renamed)
            self.client.log_dict(run_id, dict(sorted(known.items())), METRIC_NAMES_ARTIFACT)

    def log_input(self, run_id: str, name: str, digest: str, uri: Path, context: str = "input") -> None:
        """Record a stage input as an MLflow dataset whose digest is the input stage's key."""
        with warnings.catch_warnings():
            # MLflow registers its local-artifact source twice and warns that a file URI matches both.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(uri.resolve().as_uri())
        dataset = MetaDataset(source=source, name=name, digest=digest)
        entry = DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
        self.client.log_inputs(run_id, datasets=[entry])

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        elif path.is_file():
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: dict[str, Any], artifact_file: str) -> None:
        self.client.log_dict(run_id, data, artifact_file)
