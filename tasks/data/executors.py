"""Runs a data stage's work on the configured executor: local processes, Slurm or Ray.

The stages say *what* runs; `cluster.executor` says *where*. Most work is a shard job
(`map_shards`): rank i processes input shard i (`tasks.data.shards`) and writes the stage's shard i,
returning a small summary (counts, tallies) that the driver adds up (`ShardRun`: the one merge of
every stage's ranks), so no stage's corpus passes through one process. Clean and the datatrove dedup
engine run datatrove pipelines of their own (`run_pipeline`).

Which ranks are done is the run ledger's to say (`kiln.tasks.ledger.RankRecords`), not datatrove's:
each rank has a key (`RankLedger`: the job's settings and the sha256 of each file the rank reads,
as the store recorded it), and writes its record, with its summary, once its outputs are written.
Before a job starts, Kiln sets datatrove's completion markers from those records, so datatrove
skips exactly the ranks whose record holds their current key, whichever executor ran them and
whichever reruns them; a rank whose input or settings changed runs again, its old outputs removed
first. Datatrove's per-rank logs and stats land in the stage's own folder (`logging_dir`). A run
returns only when every rank is done; otherwise it raises `ExecutorError` naming each unfinished
rank's log. Each rank records the CPU seconds it used; those of ranks outside this process tree
(Slurm, a Ray cluster started elsewhere) are returned for the stage's cost, which the runner
measures for this process tree itself.

- local: `LocalPipelineExecutor`, `jobs` worker processes.
- slurm: `SlurmPipelineExecutor`, one array job per pipeline (tasks grouped `tasks_per_job` so at
  most `jobs` array tasks start a Python each), on `cluster.partition` (default: the cluster's
  default partition) with `cluster.time_limit`, in `cluster.image` under pyxis, else in this
  interpreter's environment (which the nodes then reach on a shared filesystem). Kiln polls
  `squeue` (every tenth of the time waited so far) until the array is gone, then reads the
  completion markers; an interrupted wait cancels the job.
- ray: `RayPipelineExecutor` on the cluster at `RAY_ADDRESS`, or on a local one started once per
  process. A worker that dies while running its ranks is resubmitted by datatrove itself; a rank
  that raises is reported. (datatrove 0.10.1 waits forever for an actor that dies before its
  ranks start: its placement-group future is never resolved.)

Stages run one after another (no datatrove `depends=`): the Local and Ray executors poll a
failed dependency every two minutes forever, and a Slurm `afterok` dependency would leave the
next job pending forever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import dill
import multiprocess
import psutil
from datatrove.executor import (
    LocalPipelineExecutor,
    RayPipelineExecutor,
    SlurmPipelineExecutor,
)
from datatrove.executor.base import PipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.stats import PipelineStats
from dill import CONTENTS_FMODE

from kiln.tasks.accounting import DocCounts
from kiln.tasks.data import (
    datatrove_logs,  # noqa: F401  (importing it keeps datatrove's rank logs off the terminal)
    shards,
)
from kiln.tasks.data.inspection import RemovalTally
from kiln.tasks.errors import ConfigError, InfrastructureError
from kiln.tasks.launch.cluster import SlurmSettings, container_flags, task_line
from kiln.tasks.launch.slurm_jobs import (
    JobJournal,
    journal_launch,
    live_jobs,
    scheduler_records,
    submit,
)
from kiln.tasks.ledger import RankRecords, rank_key
from kiln.tasks.store import adopt_noted, recorded_sha256, take_noted

logger = logging.getLogger("kiln.data.executors")
Kind = Literal["local", "slurm", "ray"]
KINDS: tuple[Kind, ...] = ("local", "slurm", "ray")
STATS_FILE = "stats.json"  # every rank's stats merged, in logging_dir
RANKS_DIR = "ranks"  # in a job's folder: each rank's record, with its summary (`RankLedger`)
_RANK_FILE = re.compile(r"(\d{5})(\.|$)")  # a rank's output file: its rank in five digits, then a suffix or none
# squeue is polled every tenth of the time the job has taken so far, within these bounds: a small
# job's end is seen within a fraction of a second, a long job's costs slurmctld one query a half-minute,
# and the wait never adds more than a tenth to a job's time.
_POLL_MIN_S = 0.2
_POLL_MAX_S = 30.0
_POLL_FRACTION = 0.1
# What the local executor's worker processes run, imported once by datatrove's forkserver (which forks
# every worker from it): without it each pool's workers imported datatrove and the stage's modules
# afresh, seconds per job on a busy machine. `__main__` is the forkserver's own default.
_FORKSERVER_PRELOAD = ["__main__", "kiln.tasks.data.collect", "kiln.tasks.data.clean", "kiln.tasks.data.dedup_job", "kiln.tasks.data.decontaminate",
                       "kiln.tasks.data.tokenize"]


class ExecutorError(InfrastructureError):
    """A data pipeline ended with ranks unfinished; the message names their logs. Retryable: a rerun runs
    only the unfinished ranks (their records in the run ledger)."""


@dataclass(frozen=True)
class ExecutorSettings:
    """Where data pipelines run: the `cluster` section's executor and what Slurm needs from it."""

    kind: Kind = "local"
    partition: str | None = None  # Slurm partition; None: the cluster's default
    time_limit: str = "24:00:00"  # Slurm --time for each array job
    slurm: SlurmSettings = SlurmSettings()  # cluster.slurm: account, QOS, memory, constraint, lines, modules, env
    image: str | None = None  # cluster.image: Slurm jobs run in it (pyxis); None: in this interpreter's environment
    # told where each pipeline's job ran (`launch_record`: the Slurm job id and nodes), for the stage's record
    on_job: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)
    # told each Slurm job id as it is submitted (the stage's lock records the jobs that hold its work)
    on_submit: Callable[[str], None] | None = field(default=None, compare=False)
    # where Slurm jobs' output (`<job>_<task>.out`), scripts and journal go: the stage's `logs/`, committed
    # with it; None: the pipeline's logging_dir's `slurm_logs`
    logs_dir: Path | None = None
    # `kiln-<stage>-<key>`: the start of each Slurm job's name, so `squeue` says whose it is (None: the job's own name)
    job_prefix: str | None = field(default=None, compare=False)

    def slurm_job_name(self, job_name: str) -> str:
        """The Slurm name of the pipeline `job_name` (`kiln_dedup_sign` -> `kiln-dedup-<key>-dedup-sign`)."""
        if self.job_prefix is None:
            return job_name
        return f"{self.job_prefix}-{job_name.removeprefix('kiln_').replace('_', '-')}"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"cluster.executor: {self.kind!r} is not one of {', '.join(KINDS)}")


LOCAL = ExecutorSettings()


def build_executor(
    pipeline: list, logging_dir: Path, *, tasks: int, jobs: int, settings: ExecutorSettings, job_name: str,
) -> PipelineExecutor:
    """The datatrove executor for `pipeline`: `tasks` ranks, at most `jobs` running (or submitted) at once."""
    if tasks < 1 or jobs < 1:
        raise ConfigError(f"{job_name}: tasks={tasks} and jobs={jobs} must be at least 1")
    jobs = min(jobs, tasks)
    common = {"tasks": tasks, "logging_dir": str(logging_dir), "skip_completed": True}
    if settings.kind == "local":
        multiprocess.set_forkserver_preload(_FORKSERVER_PRELOAD)  # only until the forkserver has started
        return _LocalExecutor(pipeline, workers=jobs, **common)
    tasks_per_job = math.ceil(tasks / jobs)
    if settings.kind == "ray":
        return _RayExecutor(pipeline, tasks_per_job=tasks_per_job, **common)
    site = settings.slurm
    executor = _SlurmExecutor(
        pipeline, time=settings.time_limit, partition=settings.partition or default_partition(),
        tasks_per_job=tasks_per_job, job_name=settings.slurm_job_name(job_name), cpus_per_task=site.cpus_per_task or 1,
        qos=site.qos,  # None: the partition's default; datatrove's "normal" need not exist
        sbatch_args=_sbatch_args(site), env_command=_job_environment(site, settings.image),
        srun_args=container_flags(settings.image, site.container_mounts, Path.cwd()) or None,
        slurm_logs_folder=str(slurm_logs_dir(settings, logging_dir)), **common,
    )
    if settings.image:
        executor.python = "python"  # the image's
    return executor


def slurm_logs_dir(settings: ExecutorSettings, logging_dir: Path) -> Path:
    """Where a pipeline's Slurm output files, sbatch script and job journal go (absolute: the nodes write there)."""
    return (settings.logs_dir or logging_dir / "slurm_logs").resolve()


def run_pipeline(
    pipeline: list, logging_dir: Path, *, tasks: int, jobs: int, settings: ExecutorSettings, job_name: str,
    ledger: RankLedger, outputs: Iterable[Path] = (),
) -> PipelineStats:
    """Run `pipeline` to completion on `settings`' executor; its merged stats are also in `logging_dir/stats.json`.

    The ranks `ledger` holds complete are skipped; the others' files in `outputs` (named by their rank,
    `NNNNN.*`, as shards are) are removed first. The pipeline's last step records each rank in `ledger`
    (`ShardTask`, `RecordRank`, or a writer that saves its summary there)."""
    if len(ledger.keys) != tasks:
        raise ValueError(f"{job_name}: {tasks} tasks but {len(ledger.keys)} rank keys")
    journal = (JobJournal(slurm_logs_dir(settings, logging_dir), on_submitted=settings.on_submit)
               if settings.kind == "slurm" else None)
    if journal is not None:
        _adopt_live_jobs(journal, job_name)  # an earlier driver's job still running these ranks: wait for it
    done = ledger.mark_completed(logging_dir)
    _remove_unfinished(outputs, done)
    executor = build_executor(pipeline, logging_dir, tasks=tasks, jobs=jobs, settings=settings, job_name=job_name)
    if settings.kind == "ray":
        connect_ray()
    if journal is not None:
        _say_resubmission(journal, job_name, sorted(set(range(tasks)) - done))
        executor.journal, executor.journal_name = journal, job_name  # journaled under the pipeline's name
    executor.run()  # local and Ray return when their ranks are over; Slurm returns once submitted
    if journal is not None:
        if executor.job_id not in (None, -1):  # -1: every rank was already done
            job_id = str(executor.job_id)
            _wait_for_slurm_job(job_id)
            journal.ended(job_id, scheduler_records(job_id))
        jobs = journal.jobs(job_name)
        if jobs and settings.on_job is not None:  # every job these ranks ran in, retries and adopted ones included
            settings.on_job(journal_launch(job_name, jobs, _jobs_cpu_s(jobs, ledger)))
    unfinished = executor.get_incomplete_ranks(skip_completed=True)
    if unfinished:
        raise ExecutorError(_unfinished_message(executor, logging_dir, settings, job_name, unfinished))
    return _merge_stats(logging_dir, tasks)


def _adopt_live_jobs(journal: JobJournal, job_name: str) -> None:
    """Wait for the jobs of `job_name` that an earlier driver (killed, or its attempt failed) submitted and
    the scheduler still runs, so that no rank runs in two jobs at once; record how each ended."""
    for job in journal.jobs(job_name):
        if job["tasks"] is not None:
            continue
        job_id = job["job_id"]
        adopted = bool(live_jobs([job_id]))
        if adopted:
            logger.warning("%s: Slurm job %s (ranks %s), submitted by pid %s on %s, still runs: waiting for it "
                           "instead of running its ranks again", job_name, job_id, _ranks(job["ranks"]),
                           job["pid"], job["host"])
            _wait_for_slurm_job(job_id)
        journal.ended(job_id, scheduler_records(job_id), adopted=adopted)


def _say_resubmission(journal: JobJournal, job_name: str, ranks: list[int]) -> None:
    """Say on the terminal that ranks run again, and why: how their last job's tasks ended."""
    earlier = [job for job in journal.jobs(job_name) if job["tasks"] is not None]
    if not ranks or not earlier:
        return
    last = earlier[-1]
    why = "; ".join(task_line(t) for t in last["tasks"] if t["state"] != "COMPLETED") or \
        "the scheduler no longer knows how its tasks ended"
    logger.warning("%s: resubmitting ranks %s of Slurm job %s: %s", job_name, _ranks(ranks), last["job_id"], why)


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def _jobs_cpu_s(jobs: list[dict[str, Any]], ledger: RankLedger) -> dict[str, float]:
    """Each job's ranks' CPU seconds, from their records: a rank's by the last job that ran it."""
    last_job = {rank: job["job_id"] for job in jobs for rank in job["ranks"]}
    cpu: dict[str, float] = {}
    for rank, job_id in last_job.items():
        record = ledger.done(rank) if rank < len(ledger.keys) else None
        if record is not None and record["outside_driver"]:
            cpu[job_id] = cpu.get(job_id, 0.0) + record["cpu_s"]
    return cpu


def connect_ray() -> None:
    """Join the Ray cluster at RAY_ADDRESS, else start a local one of this process's own; once per
    process (ray.init is global)."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # reads RAY_ADDRESS
    else:
        # not a bare ray.init(): it joins any `ray start` cluster on this machine (another user's, say)
        ray.init(address="local", include_dashboard=False)


def default_partition() -> str:
    """The Slurm cluster's default partition (`sinfo` marks it with `*`)."""
    if shutil.which("sinfo") is None:
        raise ExecutorError("cluster.executor is slurm but sinfo is not on PATH: install Slurm's client tools "
                            "(Debian: slurm-client) or run on a login node")
    done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ExecutorError(f"sinfo failed (exit {done.returncode}): {done.stderr.strip()}")
    default = [name.removesuffix("*") for name in done.stdout.split() if name.endswith("*")]
    if not default:
        raise ConfigError(f"cluster.partition is not set and Slurm has no default partition (partitions: "
                          f"{done.stdout.split()}); set cluster.partition=NAME")
    return default[0]


@dataclass(frozen=True)
class RankLedger:
    """A job's ranks in the run ledger: rank r is complete exactly when `folder` holds its record under
    `keys[r]` (`kiln.tasks.ledger.RankRecords`). Built by `rank_ledger`; picklable, so the rank itself
    records its summary (`record`) where it ran."""

    folder: Path
    keys: tuple[str, ...]

    @property
    def records(self) -> RankRecords:
        return RankRecords(self.folder)

    def done(self, rank: int) -> dict[str, Any] | None:
        """Rank `rank`'s record, if it finished under its current key."""
        return self.records.get(rank, self.keys[rank])

    def stale(self) -> list[int]:
        """Ranks recorded under another key than their current one (or beyond this job's ranks)."""
        return self.records.stale(self.keys)

    def record(self, rank: int, result: dict[str, Any], cpu_s: float, driver_pid: int) -> None:
        """Rank `rank` is done (its outputs written): its summary, the CPU seconds it took, and whether its
        process was outside the driver's process tree (where the stage runner cannot measure it), and the
        sha256 of the files it wrote, hashed as they were written (`store.take_noted`: a process runs one
        rank at a time), for the driver's commit."""
        self.records.put(rank, self.keys[rank], {"result": result, "cpu_s": cpu_s,
                                                 "outside_driver": not _in_process_tree(driver_pid),
                                                 "written_sha256": take_noted()})

    def mark_completed(self, logging_dir: Path) -> set[int]:
        """Set datatrove's completion markers in `logging_dir` from the ledger, stale records removed: a
        marker for each rank complete under its key and whose datatrove stats are saved whole (a rank killed
        between its record and its stats, or while datatrove wrote them, runs again), none for the others;
        returns the complete ranks."""
        records = self.records
        for rank in self.stale():
            records.discard(rank)
        markers, stats = logging_dir / "completions", logging_dir / "stats"
        markers.mkdir(parents=True, exist_ok=True)
        done = set()
        for rank in range(len(self.keys)):
            marker = markers / f"{rank:05d}"
            if self.done(rank) is not None and _stats_saved(stats / f"{rank:05d}.json"):
                marker.touch()
                done.add(rank)
            else:
                marker.unlink(missing_ok=True)
        return done

    def results(self) -> ShardRun:
        """Every rank's summary, those of ranks an earlier attempt finished included."""
        records = [self.done(rank) for rank in range(len(self.keys))]
        missing = [rank for rank, record in enumerate(records) if record is None]
        assert not missing, f"ranks {missing} have no record for their key in {self.folder}"
        for record in records:  # the files the ranks wrote need not be read again at commit
            adopt_noted(record.get("written_sha256", []))
        return ShardRun([r["result"] for r in records], sum(r["cpu_s"] for r in records if r["outside_driver"]))


def rank_ledger(folder: Path, job: str, identity: Any, inputs: Sequence[Mapping[str, Path]]) -> RankLedger:
    """The ledger of a job of `len(inputs)` ranks, its records in `folder`: rank r's key hashes the job's
    name, `identity` (what every rank computes with: settings, models, JSON-able) and the content of
    each file rank r reads (`inputs[r]`: name -> file), as the store recorded it at commit
    (`recorded_sha256`): a rank is redone when its input's bytes change, not when it is touched or moved."""
    # hashed once, not once a rank: a job's settings may hold long lists (clean's blocklists)
    settings = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    keys = tuple(rank_key(job, {"settings_sha256": settings},
                          {name: recorded_sha256(path) for name, path in files.items()}) for files in inputs)
    return RankLedger(folder, keys)


class RecordRank(PipelineStep):
    """The last step of a datatrove pipeline whose steps write their own outputs: records each rank
    in the ledger once every step before it is done."""

    name = "Kiln rank record"
    type = "KILN"

    def __init__(self, ledger: RankLedger, driver_pid: int):
        super().__init__()
        self.ledger, self.driver_pid = ledger, driver_pid

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
        started = cpu_seconds()
        for document in data or ():
            yield document
        self.ledger.record(rank, {}, cpu_seconds() - started, self.driver_pid)


class ShardTask(PipelineStep):
    """Rank r of a shard job: `work(r)`, a picklable callable that processes input shard r and returns
    a JSON-able summary, recorded in the job's ledger."""

    name = "Kiln shard task"
    type = "KILN"

    def __init__(self, work: Callable[[int], dict[str, Any]], ledger: RankLedger, driver_pid: int):
        super().__init__()
        self.work, self.ledger, self.driver_pid = work, ledger, driver_pid

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
        started = cpu_seconds()
        result = self.work(rank)
        self.ledger.record(rank, result, cpu_seconds() - started, self.driver_pid)
        self.stat_update("shards")
        yield from ()


@dataclass(frozen=True)
class ShardRun:
    """A job's ranks' summaries, in rank order, and the one way they add up. A data rank's summary holds
    `counts` (`DocCounts.as_dict`), `tally` (`RemovalTally.table`) and `shards` (each kind's listing
    entry, `RankShards.close`), and whatever else its stage adds up with `total`."""

    results: list[dict[str, Any]]  # each rank's summary, in rank order
    outside_cpu_s: float  # CPU seconds of ranks outside this process tree (Slurm; Ray on a cluster not started here)

    def counts(self) -> DocCounts:
        """Documents in, kept, removed and quarantined by reason, over every rank."""
        counts = DocCounts()
        for result in self.results:
            part = result["counts"]
            counts.num_in += part["num_in"]
            counts.num_kept += part["num_kept"]
            counts.removed.update(part["removed"])
            counts.quarantined.update(part["quarantined"])
        return counts

    def tally(self) -> RemovalTally:
        """Documents and bytes per domain and outcome, over every rank."""
        tally = RemovalTally()
        for result in self.results:
            tally.merge(result["tally"])
        return tally

    def total(self, name: str) -> Any:
        """The ranks' `name` added up: numbers add, mappings add key by key (first seen first)."""
        total: Any = None
        for result in self.results:
            total = _add(total, result[name])
        return total

    def listing(self, out_dir: Path) -> dict[str, Any]:
        """Write `out_dir`'s shard listing from the ranks' entries, in rank order (`write_listing`)."""
        return shards.write_listing(out_dir, {kind: [result["shards"].get(kind) for result in self.results]
                                              for kind in shards.KINDS})


def _add(total: Any, part: Any) -> Any:
    if isinstance(part, Mapping):
        total = {} if total is None else total
        for key, value in part.items():
            total[key] = _add(total.get(key), value)
        return total
    return part if total is None else total + part


def map_shards(work: Callable[[int], dict[str, Any]], work_dir: Path, ledger: RankLedger, *,
               settings: ExecutorSettings, jobs: int, job_name: str, outputs: Iterable[Path] = ()) -> ShardRun:
    """Run `work(rank)` for every rank of `ledger` as one job of datatrove tasks on `settings`' executor,
    at most `jobs` at once; the ranks the ledger holds complete are skipped, their summaries kept.
    `outputs`: the folders where ranks write files named by their rank (an unfinished rank's are removed)."""
    num_ranks = len(ledger.keys)
    if num_ranks == 0:
        return ShardRun([], 0.0)
    run_pipeline([ShardTask(work, ledger, os.getpid())], work_dir / "logs", tasks=num_ranks, jobs=jobs,
                 settings=settings, job_name=job_name, ledger=ledger, outputs=outputs)
    return ledger.results()


def _remove_unfinished(outputs: Iterable[Path], done: set[int]) -> None:
    """Remove the files of the ranks not in `done` from `outputs` (files `NNNNN.*`, in any subfolder)."""
    for folder in outputs:
        for path in folder.rglob("*") if folder.is_dir() else ():
            found = _RANK_FILE.match(path.name)
            if found and int(found.group(1)) not in done and path.is_file():
                path.unlink()


def cpu_seconds() -> float:
    """CPU seconds this process and its finished children have used."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _in_process_tree(pid: int) -> bool:
    """Whether this process is `pid` or one of its descendants."""
    return os.getpid() == pid or any(parent.pid == pid for parent in psutil.Process().parents())


class _SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor without its extra merge-stats job: Kiln merges the ranks' stats
    itself once the array is over, and a job chained `afterok` to a failed array would pend forever."""

    journal: JobJournal | None = None  # where run_pipeline records each submission (set before `run`)
    journal_name: str = ""  # the pipeline's job name (`kiln_clean`), under which its jobs and scripts are kept
    # what runs a rank: this interpreter (the driver's environment, on a shared filesystem; not whichever
    # `launch_pickled_pipeline` script comes first on the node's PATH), or the image's `python`
    python: str = shlex.quote(sys.executable)

    def launch_merge_stats(self) -> None:
        return None

    def launch_job(self) -> None:
        """datatrove's submission, one array over the unfinished ranks, with what it lacks: sbatch's refusal
        raised as one line (`SubmissionRefused`, never resubmitted), the script kept beside the jobs'
        output, and the job journaled as soon as it is submitted (a driver killed while waiting leaves it named)."""
        ranks = self.get_incomplete_ranks()
        if not ranks:
            self.job_id = -1
            return
        with self.logging_dir.open("executor.pik", "wb") as handle:  # what each array task loads and runs
            dill.dump(deepcopy(self), handle, fmode=CONTENTS_FMODE)
        self.save_executor_as_json()
        with self.logging_dir.open("ranks_to_run.json", "w") as handle:
            json.dump(ranks, handle)
        array = math.ceil(len(ranks) / self.tasks_per_job)
        srun = " ".join(f"--{k}={v}" for k, v in (self.srun_args or {}).items())
        pickled = self.logging_dir.resolve_paths("executor.pik")
        script = Path(self.slurm_logs_folder) / f"{self.journal_name or self.job_name}.{len(self.journal.jobs()) if self.journal else 0}.sbatch"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(self.get_launch_file_contents(
            self.get_sbatch_args(array),
            f"srun {srun} -l -n {self.nodes_per_task} {self.python} -m datatrove.tools.launch_pickled_pipeline {pickled}"))
        self.job_id = submit(script, "--export=ALL,RUN_OFFSET=0")
        logger.info("submitted Slurm job %s (%s, %d ranks) from %s", self.job_id, self.job_name, len(ranks), script)
        if self.journal is not None:
            self.journal.submitted(self.journal_name or self.job_name, str(self.job_id), ranks)

    def get_sbatch_args(self, max_array: int = 1) -> dict:
        args = super().get_sbatch_args(max_array)
        if "mem" in args:  # cluster.slurm.mem replaces datatrove's per-CPU default (sbatch refuses both)
            args.pop("mem-per-cpu")
        return args


class _LocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor; one worker runs its ranks in this process, one after another, as
    datatrove's does, but without the `multiprocess.Manager` datatrove starts first (a server process
    whose queue only numbers the workers: a tenth of a second a job, as long as a small shard's work)."""

    def run(self) -> PipelineStats:
        if self.workers != 1 or self.depends:
            return super().run()
        self._launched = True
        ranks = self.get_incomplete_ranks(range(self.local_rank_offset, self.local_rank_offset + self.local_tasks))
        if not ranks:
            return PipelineStats()
        self.save_executor_as_json()
        pipeline, stats = self.pipeline, []
        try:
            for rank in ranks:
                self.pipeline = deepcopy(pipeline)  # as datatrove's: each rank starts from the steps' fresh state
                stats.append(self._run_for_rank(rank, 0))
        finally:
            self.pipeline = pipeline
        merged = sum(stats, start=PipelineStats())
        with self.logging_dir.open("stats.json", "wt") as handle:
            merged.save_to_disk(handle)
        return merged


class _RayExecutor(RayPipelineExecutor):
    """datatrove's Ray executor, its ranks with the default SIGTERM action.

    Each rank runs in a process forked from the Ray actor, which inherits Ray's Python SIGTERM
    handler. When the actor closes its pool it SIGTERMs the forked processes; a signal that lands
    on a rank's helper thread (fsspec's IO loop) only sets a flag for the main thread, which is
    blocked on the pool's queue, so the process never exits and the stage hangs (seen here about
    once in a few dozen stages)."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1) -> PipelineStats:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return super()._run_for_rank(rank, local_rank, node_rank)


def _job_environment(site: SlurmSettings, image: str | None) -> str:
    """What a job's script runs before its `srun`: `cluster.slurm.env` exported, and without an image
    `cluster.slurm`'s modules loaded and this interpreter's environment put first (its venv activated,
    else its bin folder first on PATH). With an image its steps run in the image (`srun` gets pyxis's
    options, `container_flags`), whose environment is the job's: no module, no path of this machine's."""
    exports = [f"export {k}={shlex.quote(v)}" for k, v in site.env.items()]
    if image:
        return "\n".join(exports)
    python = (f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}" if sys.prefix != sys.base_prefix
              else f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH")
    return "\n".join([*(f"module load {m}" for m in site.modules), *exports, python])


def _sbatch_args(site: SlurmSettings) -> dict[str, str]:
    """`cluster.slurm`'s #SBATCH options as datatrove's `sbatch_args` (`--key=value` -> key: value)."""
    args = {key: value for key, value in (("account", site.account), ("constraint", site.constraint),
                                          ("mem", site.mem)) if value}
    for line in site.sbatch_lines:
        key, _, value = line.lstrip("-").partition("=")
        args[key] = value
    return args


def _wait_for_slurm_job(job_id: str) -> None:
    """Poll squeue until no task of array job `job_id` is pending or running; scancel it if interrupted
    (what ran where is the scheduler's record, read after: `scheduler_records`)."""
    started = time.monotonic()
    try:
        while True:
            done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                if "Invalid job id" in done.stderr:  # finished and already purged from slurmctld
                    return
                raise ExecutorError(f"squeue -j {job_id} failed (exit {done.returncode}): {done.stderr.strip()}")
            if not done.stdout.strip():
                return
            time.sleep(min(max(_POLL_FRACTION * (time.monotonic() - started), _POLL_MIN_S), _POLL_MAX_S))
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, check=False)
        raise


def _unfinished_message(executor: PipelineExecutor, logging_dir: Path, settings: ExecutorSettings, job_name: str,
                        ranks: list[int]) -> str:
    lines = [f"{job_name} on the {settings.kind} executor: {len(ranks)} of {executor.world_size} ranks did not "
             f"finish. Rerun the stage: the finished ranks are skipped."]
    slurm_logs = _slurm_logs(executor, logging_dir) if settings.kind == "slurm" else {}
    for rank in ranks:
        task_log = logging_dir / "logs" / f"task_{rank:05d}.log"
        logs = [task_log] + ([slurm_logs[rank][0]] if rank in slurm_logs else [])
        lines.append(f"  rank {rank}: log {' and Slurm output '.join(map(str, logs))}")
        if rank in slurm_logs and slurm_logs[rank][1] is not None:  # how the scheduler saw its task end
            lines.append(f"    Slurm job {executor.job_id} {task_line(slurm_logs[rank][1])}")
        ends = [(log, next((line.strip() for line in reversed(_lines(log)) if line.strip()), "")) for log in logs]
        lines += [f"    {log.name} ends: {end}" for log, end in ends if end] or ["    the rank never started"]
    return "\n".join(lines)


def _slurm_logs(executor: SlurmPipelineExecutor, logging_dir: Path) -> dict[int, tuple[Path, dict[str, Any] | None]]:
    """Each rank's Slurm output file (`%A_%a.out`: array index = position in ranks_to_run // tasks_per_job)
    and its array task as the scheduler recorded it (None if the journal has no record of it)."""
    ranks_file = logging_dir / "ranks_to_run.json"
    if not ranks_file.is_file() or executor.job_id in (None, -1):
        return {}
    ranks = json.loads(ranks_file.read_text())
    folder = Path(executor.slurm_logs_folder)
    job = next((j for j in (executor.journal.jobs() if executor.journal else []) if j["job_id"] == str(executor.job_id)),
               None)
    tasks = {t["task"]: t for t in (job or {}).get("tasks") or []}
    return {rank: (folder / f"{executor.job_id}_{i // executor.tasks_per_job}.out",
                   tasks.get(str(i // executor.tasks_per_job))) for i, rank in enumerate(ranks)}


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _stats_saved(path: Path) -> bool:
    """Whether datatrove saved a rank's stats whole: it writes them in place, so a rank killed meanwhile
    leaves an empty or cut file."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _merge_stats(logging_dir: Path, tasks: int) -> PipelineStats:
    """Every rank's stats, including ranks a previous attempt finished (the executors merge only their own)."""
    total = PipelineStats()
    for rank in range(tasks):
        total += PipelineStats.from_json(json.loads((logging_dir / "stats" / f"{rank:05d}.json").read_text()))
    with open(logging_dir / STATS_FILE, "w") as handle:
        total.save_to_disk(handle)
    return total
