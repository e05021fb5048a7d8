"""Where proxy trials train: processes of the sweep stage, or jobs through `cluster.launcher`.

Both take a phase's pending trials, each with its begun sub-run (`kiln.tasks.ledger.OpenSubRun`:
the partial folder `trials/.<name>.partial/` it trains in), and yield each trial's result as it
finishes. The process that trains a trial commits its sub-run when the result is final (ok or
diverged), with how it was launched, so a committed trial is what a rerun, or a resubmitted job,
finds done; the sweep records each on its MLflow child run as it comes. One that failed (an
exception, a killed process, a failed, cancelled or preempted job) is retried on its own, resuming
from its folder, up to `cluster.max_restarts` times; after that its failed result is yielded (the
sweep leaves it uncommitted, its failure recorded in its folder). A `KilnError` inside a trial (the
user's to fix, the same for every trial) stops the sweep.

- `PoolTrials` (`cluster.launcher: local`): `sweep.max_parallel` spawned processes of the stage;
  retries run alone in a fresh process (a trial that kills its process then takes no other with it).
- `JobTrials` (torchrun, slurm, kubernetes): the pending trials, longest first, are dealt into
  `sweep.max_parallel` shares, and each share is one job that trains its trials one after another in
  one process (`python -m kiln.tasks.scaling.trial_runs`). Python and torch start once per job, not once
  per trial: on this project's CPU machine a proxy trial trains in seconds, less than a job's start.
  torchrun and Slurm run one job per share (at most `max_parallel` at once: a share's next job is
  submitted only after its last one ended); a failed job is resubmitted for the share's unfinished
  trials (a committed trial is never run again; the one it was training resumes from its folder).
  Kubernetes runs one indexed Job of all shares, `max_parallel` pods at once, each index retried on
  its own by Kubernetes (`backoffLimitPerIndex`), and the Job relaunched for what is left.

Jobs, their scripts and logs live in the sweep's folder (`jobs/<phase>/`), beside the trials.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.tasks.errors import ConfigError, KilnError
from kiln.tasks.launch.kubernetes import KubernetesIndexedLauncher
from kiln.tasks.launch.launchers import LaunchError, sigterm_raises
from kiln.tasks.launch.registry import make_launcher
from kiln.tasks.launch.slurm import SlurmJobCancelled
from kiln.tasks.launch.slurm_jobs import scheduler_records, wait_for_jobs
from kiln.tasks.ledger import OpenSubRun
from kiln.tasks.scaling.sweep import (
    FINAL_STATUSES,
    Finished,
    Pending,
    SweepConfig,
    Trial,
    TrialFn,
    TrialResult,
    failed_result,
    run_trial,
    train_trial,
    trial_result,
    worker_died,
)

if TYPE_CHECKING:
    from kiln.tasks.launch.cluster import ClusterSpec
    from kiln.tasks.launch.launchers import Launcher
    from kiln.tasks.train.data_loader import Mixture

logger = logging.getLogger("kiln.sweep")

JOBS_DIR = "jobs"
JOB_FILE = "job.json"  # a launched job's trials: what `python -m kiln.tasks.scaling.trial_runs` reads
FAILED_HOSTS_FILE = "failed_hosts.json"  # hosts whose jobs failed: later jobs keep off them
POLL_S = 0.5  # how often finished trials are looked for while jobs run
USER_ERROR_EXIT = 3  # a worker's exit code when a trial raised a KilnError

def _mixture(shards: dict, shards_root: Path, trial: Trial) -> Mixture:
    from kiln.tasks.train.data_loader import mixture_with_weights  # defers torch

    return mixture_with_weights(shards, shards_root, trial.weights, f"sweep.mixtures.{trial.mixture}")


class PoolTrials:
    """Trials in `max_parallel` spawned processes of this one (`cluster.launcher: local`)."""

    def __init__(self, max_parallel: int, max_restarts: int = 2, trial_fn: TrialFn = run_trial) -> None:
        self.max_parallel, self.max_restarts, self.trial_fn = max_parallel, max_restarts, trial_fn

    def run(self, cfg: SweepConfig, shards: dict, shards_root: Path, pending: Pending,
            label: str = "") -> Iterator[Finished]:
        mixtures: dict[str, Mixture] = {}

        def mixture_of(trial: Trial) -> Mixture:
            if trial.mixture not in mixtures:
                mixtures[trial.mixture] = _mixture(shards, shards_root, trial)
            return mixtures[trial.mixture]

        retry: list[tuple[Trial, OpenSubRun, TrialResult]] = []
        for trial, run, result in self._pool(cfg, pending, mixture_of):
            if result.status in FINAL_STATUSES:
                yield trial, result
            else:
                retry.append((trial, run, result))
        for trial, run, result in retry:  # alone: a trial that kills its process takes no other with it
            for attempt in range(self.max_restarts):
                if result.status in FINAL_STATUSES:
                    break
                logger.warning("trial %s failed (%s); retrying it alone (%d of %d)", trial.name, result.reason,
                               attempt + 1, self.max_restarts)
                result = self._alone(cfg, trial, run, mixture_of(trial), shards["vocab_size"])
            yield trial, result

    def _pool(self, cfg: SweepConfig, pending: Pending,
              mixture_of: Callable[[Trial], Mixture]) -> Iterator[tuple[Trial, OpenSubRun, TrialResult]]:
        if not pending:
            return
        pool = ProcessPoolExecutor(min(self.max_parallel, len(pending)), mp_context=get_context("spawn"))
        futures: dict[Future, tuple[Trial, OpenSubRun]] = {
            pool.submit(train_trial, self.trial_fn, cfg, t, mixture_of(t), run, "local"): (t, run) for t, run in pending}
        try:
            for future in as_completed(futures):
                trial, run = futures[future]
                try:
                    result = future.result()
                except BrokenProcessPool:  # some trial killed its process: every unfinished one is retried
                    result = worker_died(cfg, trial, mixture_of(trial).vocab_size, _DIED)
                yield trial, run, result
        finally:
            # on an interrupt, trials not yet started are dropped; running ones finish and commit
            pool.shutdown(wait=True, cancel_futures=True)

    def _alone(self, cfg: SweepConfig, trial: Trial, run: OpenSubRun, mixture: Mixture, vocab_size: int
               ) -> TrialResult:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            try:
                return pool.submit(train_trial, self.trial_fn, cfg, trial, mixture, run, "local").result()
            except BrokenProcessPool:
                return worker_died(cfg, trial, vocab_size, _DIED)


_DIED = "its worker process died (killed, e.g. out of memory, or crashed)"


def deal(pending: Pending, shares: int) -> list[Pending]:
    """The trials (longest first) dealt round-robin into `shares` non-empty shares: each share's job
    then takes about as long as the others."""
    dealt: list[Pending] = [[] for _ in range(min(shares, len(pending)))]
    for i, item in enumerate(pending):
        dealt[i % len(dealt)].append(item)
    return dealt


class JobTrials:
    """Trials as jobs through `launcher` (torchrun, slurm, kubernetes), `max_parallel` at a time.

    `cluster` is the cluster section; each job gets one process on one node (and one GPU when the
    nodes have any). `jobs_dir` holds each phase's job files, scripts and logs."""

    def __init__(self, launcher: str, cluster: ClusterSpec, max_parallel: int, jobs_dir: Path, *,
                 poll_s: float = POLL_S, launcher_options: dict[str, Any] | None = None,
                 committed_dir: Path | None = None, on_submit: Callable[[str], None] | None = None,
                 earlier_jobs: list[str] | None = None) -> None:
        # absolute: the jobs write their logs there from the nodes, and records name them
        self.launcher, self.max_parallel, self.jobs_dir, self.poll_s = launcher, max_parallel, jobs_dir.resolve(), poll_s
        # where jobs_dir will be once its stage commits (its partial folder renamed): the logs records name
        self.committed_dir = committed_dir.resolve() if committed_dir is not None else self.jobs_dir
        self.cluster = cluster.model_copy(update={"nodes": 1, "gpus_per_node": min(cluster.gpus_per_node, 1)})
        self.max_restarts = cluster.max_restarts
        self.launcher_options = launcher_options or {}
        self._jobs: dict[str, list[dict[str, Any]]] = {}  # trial -> each job given it, in order (`_ran`)
        self._jobs_lock = threading.Lock()
        self.on_submit = on_submit  # told each Slurm job's id as it is submitted (the stage's lock records it)
        # jobs of a driver that died that may still train these trials: waited for before any job is submitted
        self.earlier_jobs = list(earlier_jobs or [])

    def launch_record(self, name: str) -> dict[str, Any] | None:
        """Where trial `name` ran (see `TrialLauncher.launch_record`): each job that was given it, its
        nodes, state, start and end as the scheduler recorded them (`scheduler_records`) and its log,
        named where it lies once the stage commits. Every job but the last failed it (the trial was
        resubmitted); the last too when the trial never committed. Its CPU seconds are the trial's own
        (its committed manifest's), spent in jobs outside the stage's processes."""
        with self._jobs_lock:
            jobs = list(self._jobs.get(name, []))
        if not jobs:
            return None
        committed = jobs[-1]["run"].committed()
        attempts = []
        for number, job in enumerate(jobs, 1):
            tasks = job["tasks"]
            nodes = sorted({n for t in tasks for n in t["nodes"]})
            failed = number < len(jobs) or committed is None
            state = ",".join(sorted({t["state"] for t in tasks})) or job["state"]
            attempts.append({"attempt": number, "job_id": job["job_id"], "nodes": nodes, "tasks": tasks,
                             "state": state, "failed": failed,
                             # a node is blamed for a job that died on it, not for one someone cancelled
                             "failed_hosts": nodes if failed and state not in ("COMPLETED", "CANCELLED") else [],
                             "log": job["log"]})
        cpu_s = float((committed or {}).get("launch", {}).get("cpu_s", 0.0))
        return {"launcher": self.launcher, "job_name": jobs[-1]["job_name"], "job_ids": [a["job_id"] for a in attempts],
                "nodes": sorted({n for a in attempts for n in a["nodes"]}), "attempts": attempts,
                "worker_cpu_s": cpu_s}

    def _ran(self, todo: list[Pending], job: Launcher, job_id: str | None, log: Path | None, state: str) -> None:
        """Job `job_id` was given the trials of `todo` and has ended: what the scheduler recorded of it."""
        if job_id is None:  # never submitted (a refusal): nothing ran
            return
        tasks = scheduler_records(job_id) if self.launcher == "slurm" else []
        if log is not None and log.resolve().is_relative_to(self.jobs_dir):
            log = self.committed_dir / log.resolve().relative_to(self.jobs_dir)
        entry = {"job_id": job_id, "job_name": job.job_name, "tasks": tasks, "state": state,
                 "log": str(log) if log is not None else None}
        with self._jobs_lock:
            for share in todo:
                for trial, run in share:
                    self._jobs.setdefault(trial.name, []).append({**entry, "run": run})

    def run(self, cfg: SweepConfig, shards: dict, shards_root: Path, pending: Pending,
            label: str = "trials") -> Iterator[Finished]:

        if not pending:
            return
        if self.earlier_jobs:  # never two jobs on one trial: the earlier job commits what it finishes, then resumes none
            wait_for_jobs(self.earlier_jobs, f"sweep {label}")
            self.earlier_jobs = []
        shares = deal(pending, self.max_parallel)
        # Kubernetes: one indexed Job holds every share and runs max_parallel of them at once
        units = [shares] if self.launcher == "kubernetes" else [[share] for share in shares]
        state = _JobState()
        threads = [threading.Thread(target=self._unit, args=(cfg, shards, shards_root, unit, f"{label}-{i}", state),
                                    name=f"kiln-sweep-{label}-{i}", daemon=True) for i, unit in enumerate(units)]
        for thread in threads:
            thread.start()
        with sigterm_raises("the sweep's trial jobs"):
            try:
                while True:
                    running = any(thread.is_alive() for thread in threads)
                    yield from state.newly_final(pending)
                    if not running:
                        break
                    time.sleep(self.poll_s)
            except BaseException:  # an interrupt, or the caller stopped reading: no job may outlive the sweep
                state.stop_all()
                for thread in threads:
                    thread.join()
                raise
        if state.error is not None:
            raise state.error
        for trial, run in pending:
            if trial.name not in state.done:
                yield trial, failed_result(run.failure()) or worker_died(
                    cfg, trial, shards["vocab_size"], f"its job failed {self.max_restarts + 1} times; last: "
                    f"{state.failures.get(trial.name, 'no result')}")

    def _unit(self, cfg: SweepConfig, shards: dict, shards_root: Path, unit: list[Pending], name: str,
              state: _JobState) -> None:
        """One job (a share; for Kubernetes every share, one index each), resubmitted while trials remain."""

        folder = self.jobs_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        job = self._launcher(folder, name, len(unit))
        for _ in range(self.max_restarts + 1):
            todo = [[(t, run) for t, run in share if state.unfinished(t.name, run)] for share in unit]
            todo = [share for share in todo if share]
            if not todo or state.stopping.is_set():
                return
            (folder / JOB_FILE).write_text(json.dumps({
                "sweep": cfg.model_dump(mode="json"),  # loads back as it is (no optim.lr: see SweepConfig)
                "shards": shards, "shards_root": str(shards_root.resolve()), "launcher": self.launcher,
                "shares": [[{"trial": asdict(t), "run": run.as_json()} for t, run in share] for share in todo],
            }, indent=1))
            if self.launcher == "kubernetes":  # one index per share still unfinished
                job.completions, job.parallelism = len(todo), min(self.max_parallel, len(todo))
            state.started(job)
            try:
                launched = job.launch(self._command(folder))
            except LaunchError as error:
                state.ended(job)
                self._ran(todo, job, error.job_id, error.log, getattr(error, "state", "FAILED"))
                if state.stopping.is_set():
                    return
                user_error = _user_error([run for share in todo for _, run in share])
                # a cancelled (scancel) or preempted job is its trials' failure, not the sweep's: resubmitted alone
                cancelled = isinstance(error, SlurmJobCancelled)
                if user_error is not None or not (error.retryable or cancelled):
                    state.fail(user_error or error)
                    return
                # the launcher's words for a cancelled training job ("not relaunched") are not the sweep's
                why = (f"Slurm job {error.job_id} ({job.job_name}) on {','.join(error.nodes) or 'no node'} was "
                       f"cancelled (scancel or preemption); log: {error.log}" if cancelled else str(error).splitlines()[0])
                logger.warning("sweep job %s %s; resubmitting it for its unfinished trials: %s", name,
                               "was cancelled" if cancelled else "failed", why)
                state.failed([t.name for share in todo for t, _ in share], why)
                continue
            state.ended(job)
            self._ran(todo, job, launched.job_id, launched.log, "COMPLETED")
            if not launched.submitted:
                state.fail(ConfigError(f"cluster.launcher={self.launcher}: {launched.message}. The sweep waits for "
                                       "its jobs, so the client must be on PATH where Kiln runs"))
                return

    def _launcher(self, folder: Path, name: str, shares: int) -> Launcher:

        options = {"job_name": f"kiln-sweep-{name}".lower(), "nproc_per_node": 1, "env": {"OMP_NUM_THREADS": "1"},
                   "failed_hosts_file": self.jobs_dir / FAILED_HOSTS_FILE, **self.launcher_options}
        if self.launcher == "kubernetes":

            return KubernetesIndexedLauncher(self.cluster, folder, completions=shares,
                                             parallelism=min(self.max_parallel, shares),
                                             backoff_limit_per_index=self.max_restarts, **options)
        if self.launcher == "slurm":
            options["torchrun"] = False  # one process: no rendezvous to pay for
            options["on_submit"] = self.on_submit
        return make_launcher(self.launcher, self.cluster, folder, **options)

    def _command(self, folder: Path) -> list[str]:
        command = ["-m", "kiln.tasks.scaling.trial_runs", str((folder / JOB_FILE).resolve())]
        if self.launcher == "kubernetes":  # each index of the Job takes its share
            return [*command, "--share-env", "JOB_COMPLETION_INDEX"]
        return [*command, "--share", "0"]


class _JobState:
    """What the job threads and the waiting thread share."""

    def __init__(self) -> None:
        self.done: set[str] = set()  # yielded as final (and committed by the sweep: their folders move)
        self.failures: dict[str, str] = {}
        self.error: KilnError | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._active: set[Launcher] = set()

    def unfinished(self, name: str, run: OpenSubRun) -> bool:
        with self._lock:
            if name in self.done:
                return False
        return run.committed() is None

    def newly_final(self, pending: Pending) -> list[Finished]:
        """The trials their jobs committed since the last call, with their results (their manifests' stats)."""
        found = []
        for trial, run in pending:
            with self._lock:
                if trial.name in self.done:
                    continue
            manifest = run.committed()
            if manifest is not None:
                with self._lock:
                    self.done.add(trial.name)
                found.append((trial, trial_result(manifest["stats"])))
        return found

    def started(self, job: Launcher) -> None:
        with self._lock:
            self._active.add(job)
            if self.stopping.is_set():  # stopped while this job was being submitted
                job.stop()

    def ended(self, job: Launcher) -> None:
        with self._lock:
            self._active.discard(job)

    def failed(self, names: list[str], why: str) -> None:
        with self._lock:
            self.failures |= dict.fromkeys(names, why)

    def fail(self, error: KilnError) -> None:
        """A failure no retry can cure: stop every job, and the sweep raises it."""
        with self._lock:
            self.error = self.error or error
        self.stop_all()

    def stop_all(self) -> None:
        self.stopping.set()
        with self._lock:
            active = list(self._active)
        for job in active:
            job.stop()


def _user_error(runs: list[OpenSubRun]) -> KilnError | None:
    """The KilnError a worker recorded as one of these trials' failure (no retry can cure it), raised again here."""
    for run in runs:
        failure = run.failure()
        if failure is not None and failure.get("retryable") is False:
            return KilnError(f"sweep trial {run.name}: {failure['message']}")
    return None


def main(argv: list[str] | None = None) -> None:
    """Train a share of a sweep job's trials, one after another, in this process."""
    import os

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("job", type=Path)
    parser.add_argument("--share", type=int)
    parser.add_argument("--share-env", help="the environment variable holding the share's index (an indexed Job's)")
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    index = args.share if args.share is not None else int(os.environ[args.share_env])
    cfg = SweepConfig.model_validate(job["sweep"])
    for entry in job["shares"][index]:
        trial, run = Trial(**entry["trial"]), OpenSubRun.from_json(entry["run"])
        if not run.folder.is_dir():  # committed while this job was being submitted: the trial is done
            continue
        try:
            train_trial(run_trial, cfg, trial, _mixture(job["shards"], Path(job["shards_root"]), trial), run,
                        job["launcher"])
        except KilnError as error:  # the user's to fix: no retry can help, so say so and stop
            run.record_failure({"error": type(error).__name__, "message": str(error), "retryable": False})
            raise SystemExit(USER_ERROR_EXIT) from error


if __name__ == "__main__":
    main()
