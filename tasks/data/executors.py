"""Runs a data stage's work on the configured executor: local processes, Slurm or Ray.

The stages say *what* runs; `cluster.executor` says *where*. Most work is a shard job
(`map_shards`): rank i processes input shard i (`tasks.data.shards`) and writes the stage's shard i,
returning a small summary (counts, tallies) that the driver adds up, so no stage's corpus passes
through one process. Clean and the datatrove dedup engine run datatrove pipelines of their own
(`run_pipeline`). Whatever the executor, datatrove's completion markers, per-rank logs and stats
land in the stage's own folder (`logging_dir`), so a rerun of a failed stage skips the ranks that
finished (`reset_unless` keeps that folder only while the ranks' plan, their config and input
shards, is the same). A run returns only when every rank is done; otherwise it raises
`ExecutorError` naming each unfinished rank's log. Each rank records the CPU seconds it used; those
of ranks outside this process tree (Slurm, a Ray cluster started elsewhere) are returned for the
stage's cost, which the runner measures for this process tree itself.

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

import json
import math
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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

from kiln.tasks.data import datatrove_logs  # noqa: F401  (importing it keeps datatrove's rank logs off the terminal)
from kiln.tasks.errors import ConfigError, InfrastructureError
from kiln.tasks.launch.cluster import SlurmSettings, container_flags, launch_record

if TYPE_CHECKING:
    from kiln.tasks.config import ClusterConfig

Kind = Literal["local", "slurm", "ray"]
KINDS: tuple[Kind, ...] = ("local", "slurm", "ray")
STATS_FILE = "stats.json"  # every rank's stats merged, in logging_dir
PLAN_FILE = "plan.json"  # in a job's folder: what its ranks computed with (`reset_unless`)
RESULTS_DIR = "results"  # in a job's folder: each rank's summary (`map_shards`)
# squeue is polled every tenth of the time the job has taken so far, within these bounds: a small
# job's end is seen within a fraction of a second, a long job's costs slurmctld one query a half-minute,
# and the wait never adds more than a tenth to a job's time.
_POLL_MIN_S = 0.2
_POLL_MAX_S = 30.0
_POLL_FRACTION = 0.1
# What the local executor's worker processes run, imported once by datatrove's forkserver (which forks
# every worker from it): without it each pool's workers imported datatrove and the stage's modules
# afresh, seconds per job on a busy machine. `__main__` is the forkserver's own default.
_FORKSERVER_PRELOAD = ["__main__", "kiln.tasks.data.clean", "kiln.tasks.data.dedup_job", "kiln.tasks.data.decontaminate",
                       "kiln.tasks.data.tokenize"]


class ExecutorError(InfrastructureError):
    """A data pipeline ended with ranks unfinished; the message names their logs. Retryable: a rerun runs
    only the unfinished ranks (datatrove's completion markers)."""


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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"cluster.executor: {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig,
                     on_job: Callable[[dict[str, Any]], None] | None = None) -> ExecutorSettings:
        if cluster.executor != "slurm":  # the Slurm fields mean nothing to the other executors
            return cls(cluster.executor, on_job=on_job)
        return cls("slurm", cluster.partition, cluster.time_limit, cluster.slurm, cluster.image, on_job)


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
        return LocalPipelineExecutor(pipeline, workers=jobs, **common)
    tasks_per_job = math.ceil(tasks / jobs)
    if settings.kind == "ray":
        return _RayExecutor(pipeline, tasks_per_job=tasks_per_job, **common)
    site = settings.slurm
    return _SlurmExecutor(
        pipeline, time=settings.time_limit, partition=settings.partition or default_partition(),
        tasks_per_job=tasks_per_job, job_name=job_name,
        qos=site.qos,  # None: the partition's default; datatrove's "normal" need not exist
        sbatch_args=_sbatch_args(site), env_command=_job_environment(site, settings.image),
        srun_args=container_flags(settings.image, site.container_mounts, Path.cwd()) or None, **common,
    )


def run_pipeline(
    pipeline: list, logging_dir: Path, *, tasks: int, jobs: int, settings: ExecutorSettings, job_name: str,
) -> PipelineStats:
    """Run `pipeline` to completion on `settings`' executor; its merged stats are also in `logging_dir/stats.json`."""
    executor = build_executor(pipeline, logging_dir, tasks=tasks, jobs=jobs, settings=settings, job_name=job_name)
    if settings.kind == "ray":
        connect_ray()
    executor.run()  # local and Ray return when their ranks are over; Slurm returns once submitted
    if settings.kind == "slurm" and executor.job_id not in (None, -1):  # -1: every rank was already done
        nodes = _wait_for_slurm_job(str(executor.job_id))
        if settings.on_job is not None:
            settings.on_job(launch_record("slurm executor", job_name, [
                {"attempt": 1, "job_id": str(executor.job_id), "nodes": nodes}], 0.0))
    unfinished = executor.get_incomplete_ranks(skip_completed=True)
    if unfinished:
        raise ExecutorError(_unfinished_message(executor, logging_dir, settings, job_name, unfinished))
    return _merge_stats(logging_dir, tasks)


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


def reset_unless(work: Path, plan: str, clear: Iterable[Path] = ()) -> None:
    """Keep `work` (completion markers, finished ranks' results) when it was made under `plan` (what
    the ranks compute with: config, model digests, their input shards), so a rerun resumes; else empty
    it and the `clear` folders (the outputs its ranks wrote)."""
    plan_file = work / PLAN_FILE
    if plan_file.is_file() and plan_file.read_text() == plan:
        return
    for folder in (work, *clear):
        shutil.rmtree(folder, ignore_errors=True)
    work.mkdir(parents=True)
    plan_file.write_text(plan)  # last: a reset cut short leaves no plan, so the next run resets again


def shard_plan(job_name: str, settings: Any, inputs: Iterable[Path]) -> str:
    """A job's plan (see `reset_unless`): its name, its JSON-able `settings`, its input files (path,
    size, modification time)."""
    files = [(str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in inputs]
    return json.dumps({"job": job_name, "settings": settings, "inputs": files}, sort_keys=True, default=str)


class ShardTask(PipelineStep):
    """Rank r of a shard job: `work(r)`, a picklable callable that processes input shard r and returns
    a JSON-able summary, saved by `save_result`."""

    name = "Kiln shard task"
    type = "KILN"

    def __init__(self, work: Callable[[int], dict[str, Any]], results: Path, driver_pid: int):
        super().__init__()
        self.work, self.results, self.driver_pid = work, results, driver_pid

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
        started = cpu_seconds()
        result = self.work(rank)
        save_result(self.results, rank, result, cpu_seconds() - started, self.driver_pid)
        self.stat_update("shards")
        yield from ()


def save_result(results: Path, rank: int, result: dict[str, Any], cpu_s: float, driver_pid: int) -> None:
    """A rank's summary, the CPU seconds it took, and whether its process was outside the driver's
    process tree (where the stage runner cannot measure it), written atomically to `results`."""
    record = {"result": result, "cpu_s": cpu_s, "outside_driver": not _in_process_tree(driver_pid)}
    results.mkdir(parents=True, exist_ok=True)
    tmp = results / f"{rank:05d}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, results / f"{rank:05d}.json")


@dataclass(frozen=True)
class ShardRun:
    results: list[dict[str, Any]]  # each rank's summary, in rank order
    outside_cpu_s: float  # CPU seconds of ranks outside this process tree (Slurm; Ray on a cluster not started here)


def read_results(results: Path, num_ranks: int) -> ShardRun:
    """Every rank's saved summary (`save_result`), including those a previous attempt saved."""
    records = [json.loads((results / f"{rank:05d}.json").read_text()) for rank in range(num_ranks)]
    return ShardRun([r["result"] for r in records], sum(r["cpu_s"] for r in records if r["outside_driver"]))


def map_shards(work: Callable[[int], dict[str, Any]], num_shards: int, work_dir: Path, *, settings: ExecutorSettings,
               jobs: int, job_name: str, plan: str, clear: Iterable[Path] = ()) -> ShardRun:
    """Run `work(rank)` for every rank below `num_shards` as one job of `num_shards` datatrove tasks on
    `settings`' executor, at most `jobs` at once; ranks a previous attempt under the same `plan`
    finished are skipped (their results kept). `clear`: output folders emptied when the plan changed."""
    if num_shards == 0:
        return ShardRun([], 0.0)
    reset_unless(work_dir, plan, clear)
    run_pipeline([ShardTask(work, work_dir / RESULTS_DIR, os.getpid())], work_dir / "logs", tasks=num_shards,
                 jobs=jobs, settings=settings, job_name=job_name)
    return read_results(work_dir / RESULTS_DIR, num_shards)


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

    def launch_merge_stats(self) -> None:
        return None

    def get_sbatch_args(self, max_array: int = 1) -> dict:
        args = super().get_sbatch_args(max_array)
        if "mem" in args:  # cluster.slurm.mem replaces datatrove's per-CPU default (sbatch refuses both)
            args.pop("mem-per-cpu")
        return args


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


def _wait_for_slurm_job(job_id: str) -> list[str]:
    """Poll squeue until no task of array job `job_id` is pending or running; scancel it if interrupted.
    The nodes its tasks were seen running on (squeue's node lists, as Slurm writes them)."""
    started = time.monotonic()
    nodes: set[str] = set()
    try:
        while True:
            done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %N"], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                if "Invalid job id" in done.stderr:  # finished and already purged from slurmctld
                    return sorted(nodes)
                raise ExecutorError(f"squeue -j {job_id} failed (exit {done.returncode}): {done.stderr.strip()}")
            if not done.stdout.strip():
                return sorted(nodes)
            nodes |= {fields[1] for fields in map(str.split, done.stdout.splitlines()) if len(fields) > 1}
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
        logs = [task_log] + ([slurm_logs[rank]] if rank in slurm_logs else [])
        lines.append(f"  rank {rank}: log {' and Slurm output '.join(map(str, logs))}")
        ends = [(log, next((line.strip() for line in reversed(_lines(log)) if line.strip()), "")) for log in logs]
        lines += [f"    {log.name} ends: {end}" for log, end in ends if end] or ["    the rank never started"]
    return "\n".join(lines)


def _slurm_logs(executor: SlurmPipelineExecutor, logging_dir: Path) -> dict[int, Path]:
    """Each rank's Slurm output file (`%A_%a.out`: array index = position in ranks_to_run // tasks_per_job)."""
    ranks_file = logging_dir / "ranks_to_run.json"
    if not ranks_file.is_file() or executor.job_id in (None, -1):
        return {}
    ranks = json.loads(ranks_file.read_text())
    folder = Path(executor.slurm_logs_folder)
    return {rank: folder / f"{executor.job_id}_{i // executor.tasks_per_job}.out" for i, rank in enumerate(ranks)}


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _merge_stats(logging_dir: Path, tasks: int) -> PipelineStats:
    """Every rank's stats, including ranks a previous attempt finished (the executors merge only their own)."""
    total = PipelineStats()
    for rank in range(tasks):
        total += PipelineStats.from_json(json.loads((logging_dir / "stats" / f"{rank:05d}.json").read_text()))
    with open(logging_dir / STATS_FILE, "w") as handle:
        total.save_to_disk(handle)
    return total
