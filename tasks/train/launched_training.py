"""Run a training stage through a launcher (torchrun here, a Slurm job, a Kubernetes Job) and report
it as the in-process loop would.

Every rank of the job runs `tasks.train.dist_worker`, i.e. `train_model` with the configured
parallel layout: sharded DCP checkpoints in `out_dir` (a crashed attempt resumes there), the loss
monitor's rollbacks, and — from rank 0 — the gathered `model/`, `metrics.json`,
`train_metrics.jsonl` and the loss plot, so later stages (anneal, evaluate) read the same files
whichever way training ran. `out_dir` and the data must therefore be on a filesystem every node
shares. This module owns the launch and the relaunch after a failed job (excluding the failed
hosts where the launcher can), and reports the worker's metrics and health events to this
process's callbacks while the job runs (`LiveReport` tails rank 0's `train_metrics.jsonl` and
`health_events.jsonl` on the shared filesystem), so curves and loss alerts do not wait for its end.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.tasks.constants import METRICS_LOG
from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec, launch_record
from kiln.tasks.launch.launchers import Launcher, LaunchError, record_failed_hosts
from kiln.tasks.launch.rank_hosts import (
    REGISTRY_DIR,
    failed_ranks,
    first_failure_unix,
    hosts_of_failed_ranks,
    read_registry,
    reset_registry,
)
from kiln.tasks.launch.registry import make_launcher
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.dist_worker import WORKER_CPU_DIR, worker_cpu_s
from kiln.tasks.train.health import EVENTS_FILE
from kiln.tasks.train.trainer import TrainResult, read_result, write_metrics

logger = logging.getLogger("kiln.launch.training")

WORKER_CONFIG = "dist_config.json"
WORKER_RESULT = "dist_result.json"
LAUNCH_FILE = "launch.json"  # where the run ran (`launch_record`)
FAILED_HOSTS_FILE = "failed_hosts.json"


def train_with_launcher(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, dims: ParallelDims,
                        cluster: ClusterSpec, manifest: Path, data_root: Path, out_dir: Path, *,
                        launcher: str = "torchrun", init_model_dir: Path | None = None,
                        branch_from: Path | None = None,
                        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
                        on_event: Callable[[dict[str, Any]], None] | None = None,
                        callbacks: Sequence[CallbackSpec] = (), job_name: str = "kiln-train",
                        timeout_s: float | None = None,
                        on_launch: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Train through `launcher` (a `cluster.launcher` name: torchrun, slurm, kubernetes) on
    `cluster.nodes` nodes of `dims.world_size / cluster.nodes` processes each.

    A failed job is relaunched (up to `cluster.max_restarts` times; never one the scheduler refused
    or a person scancelled, whose errors are not retryable: no node failed) and resumes from its
    last DCP checkpoint; the failed ranks' hosts go to `failed_hosts.json`, which the cluster
    launchers exclude from the next submission (Slurm: unless that would leave too few nodes, see
    `tasks.launch.slurm`). Each failure is a `process_failure` event: failed ranks and hosts, the
    job id, what the relaunch excluded, and the measured time from the failure to the relaunched
    job's first step; it joins the worker's own health events (rollbacks) in the result.
    `init_model_dir` is a saved model to start from (anneal), `branch_from` a checkpoint to go on from (an
    adjustment), as in `train_model`; `callbacks` are
    built in every worker (see `CallbackSpec`); `timeout_s` bounds each launch. `on_launch(record)`
    gets where it ran (`launch_record`), also written to `out_dir/launch.json`.
    """
    if dims.world_size % cluster.nodes:
        raise ConfigError(f"the layout has {dims.world_size} processes, which cluster.nodes={cluster.nodes} cannot "
                          "split evenly: make the layout's world size a multiple of cluster.nodes")
    config = {
        "model": model_cfg.model_dump(mode="json"), "optim": optim_cfg.model_dump(mode="json"),
        "train": run_cfg.model_dump(mode="json"), "parallel": dims.model_dump(mode="json"),
        "manifest": str(manifest.resolve()), "data_root": str(data_root.resolve()), "out_dir": str(out_dir.resolve()),
        **({"callbacks": [spec.to_json() for spec in callbacks]} if callbacks else {}),
        **({"init_model_dir": str(init_model_dir.resolve())} if init_model_dir is not None else {}),
        **({"branch_from": str(branch_from.resolve())} if branch_from is not None else {}),
    }
    (out_dir / WORKER_CONFIG).write_text(json.dumps(config, indent=2))
    failures_file = out_dir / FAILED_HOSTS_FILE
    job = make_launcher(launcher, cluster, out_dir, job_name=job_name, nproc_per_node=dims.world_size // cluster.nodes,
                        env={"OMP_NUM_THREADS": "1"}, failed_hosts_file=failures_file, timeout_s=timeout_s)
    command = ["-m", "kiln.tasks.train.dist_worker", "--config", str((out_dir / WORKER_CONFIG).resolve()),
               "--out", str((out_dir / WORKER_RESULT).resolve())]
    registry = out_dir / REGISTRY_DIR
    shutil.rmtree(out_dir / WORKER_CPU_DIR, ignore_errors=True)  # this attempt's cost: an earlier one's was its own
    failures: list[dict] = []
    attempts: list[dict] = []
    with LiveReport(out_dir, on_metrics, on_event):
        _launch_attempts(job, command, cluster, registry, failures, attempts, failures_file, out_dir, launcher,
                         job_name, on_launch)
    result = read_result(out_dir / WORKER_RESULT)
    if failures:
        failures[-1]["step"] = result.resumed_from_step or 0
        failures[-1]["time_to_resume_s"] = result.first_step_unix - failures[-1]["failed_at_unix"]
    if failures:
        attempts[-1]["time_to_resume_s"] = failures[-1]["time_to_resume_s"]
    _record_launch(out_dir, launcher, job_name, attempts, on_launch)
    result.health_events = [*result.health_events, *failures]
    if on_metrics is not None:  # the train metrics went while the job ran; the validation loss comes at its end
        val = {"val_loss": result.val_loss, **{f"val_loss/{d}": v for d, v in result.val_loss_by_domain.items()}}
        on_metrics(result.steps, val)
    if on_event is not None:  # the worker's own events (rollbacks) went live
        for event in failures:
            on_event(event)
    write_metrics(result, out_dir)  # with the relaunches' events
    return result


class LiveReport:
    """While a launched job runs, every `interval_s` (and once more as it ends): the lines rank 0 has
    appended to `health_events.jsonl` (a rollback, giving up) since the last look go to `on_event`, then
    those of `train_metrics.jsonl` to `on_metrics`. Only whole lines count (a line being written waits
    for the next look). A relaunched job logs the steps after its checkpoint again: they
    are reported again, as they ran. A callback that raises is logged, never stops the wait."""

    def __init__(self, out_dir: Path, on_metrics: Callable[[int, dict[str, float]], None] | None,
                 on_event: Callable[[dict[str, Any]], None] | None, interval_s: float = 0.5) -> None:
        # events first at every look: an alert must not wait behind a backlog of metrics
        self.files = [(out_dir / EVENTS_FILE, on_event, on_event), (out_dir / METRICS_LOG, self._metrics, on_metrics)]
        self.offsets = {path: 0 for path, _, _ in self.files}
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-live-report", daemon=True)
        self.on_metrics = on_metrics

    def _metrics(self, record: dict[str, Any]) -> None:
        step = record.pop("step")
        self.on_metrics(step, record)

    def poll(self) -> None:
        for path, deliver, callback in self.files:
            if callback is None or not path.is_file():
                continue
            with path.open("rb") as handle:
                handle.seek(self.offsets[path])
                chunk = handle.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[path] += len(whole)
            for line in whole.decode().splitlines():
                if line.strip():
                    try:
                        deliver(json.loads(line))
                    except Exception:  # a tracking outage must not end the wait for the job
                        logger.exception("reporting %s from %s failed", line[:200], path.name)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def __enter__(self) -> LiveReport:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()


def _launch_attempts(job: Launcher, command: list[str], cluster: ClusterSpec, registry: Path, failures: list[dict],
                     attempts: list[dict], failures_file: Path, out_dir: Path, launcher: str, job_name: str,
                     on_launch: Callable[[dict[str, Any]], None] | None) -> None:
    """Launch the job, relaunching a failed one up to `cluster.max_restarts` times; `failures` and
    `attempts` record each try."""
    for attempt in range(cluster.max_restarts + 1):
        reset_registry(registry)  # so a record cannot be an earlier launch's
        try:
            launched = job.launch(command)
        except LaunchError as error:
            _note_exclusion(failures, job)
            attempts.append({"attempt": attempt + 1, "job_id": error.job_id, "nodes": _nodes(registry),
                             "failed": str(error).split("\n")[0][:300]})
            if attempt == cluster.max_restarts or not error.retryable:  # a refusal comes back the same
                _record_launch(out_dir, launcher, job_name, attempts, on_launch)
                raise
            failures.append(_failure_event(error, registry, attempt + 1))
            attempts[-1].update(failed_hosts=failures[-1]["hosts"], failed_ranks=failures[-1]["failed_ranks"])
            record_failed_hosts(failures_file, failures[-1]["hosts"])
            logger.warning("training job failed: ranks %s on %s (attempt %d); relaunching",
                           failures[-1]["failed_ranks"], ", ".join(failures[-1]["hosts"]) or "no host Kiln could name",
                           attempt + 1)
            continue
        _note_exclusion(failures, job)
        attempts.append({"attempt": attempt + 1, "job_id": launched.job_id, "nodes": _nodes(registry),
                         "excluded": list(job.excluded)})
        if not launched.submitted:
            raise ConfigError(f"cluster.launcher={launcher}: {launched.message}. Training waits for its job, so "
                              "the client must be on PATH where Kiln runs")
        break


def _record_launch(out_dir: Path, launcher: str, job_name: str, attempts: list[dict],
                   on_launch: Callable[[dict[str, Any]], None] | None) -> None:
    record = launch_record(launcher, job_name, attempts, worker_cpu_s(out_dir / WORKER_CPU_DIR))
    (out_dir / LAUNCH_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if on_launch is not None:
        on_launch(record)


def _nodes(registry: Path) -> list[str]:
    return sorted({record["host"] for record in read_registry(registry).values()})


def _failure_event(error: LaunchError, registry: Path, attempt: int) -> dict[str, Any]:
    """A `process_failure` event for a failed launch (its `step` and `time_to_resume_s` come once a relaunch ran).

    The hosts are the failed ranks' (the rank registry and torchrun's failure summary in the job's
    log), else those the launcher names. `failed_at_unix` is when torchrun saw the first failure
    (whole seconds) where its summary says, else when the launcher reported it."""
    detected = time.time()
    log = error.log.read_text(errors="replace") if error.log is not None and error.log.is_file() else str(error)
    return {"kind": "process_failure", "action": "relaunch", "attempt": attempt, "job_id": error.job_id,
            "failed_ranks": failed_ranks(log), "hosts": hosts_of_failed_ranks(registry, log) or error.hosts,
            "failed_at_unix": first_failure_unix(log) or detected, "detected_at_unix": detected,
            "error": str(error)[-400:]}


def _note_exclusion(failures: list[dict], job: Launcher) -> None:
    """On the failure that caused this relaunch: what it excluded, and the failed hosts it had to use again."""
    if failures and "excluded_on_relaunch" not in failures[-1]:
        failures[-1]["excluded_on_relaunch"] = list(job.excluded)
        if job.exclusion_dropped:
            failures[-1]["exclusion_dropped"] = list(job.exclusion_dropped)
