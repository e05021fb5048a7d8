"""What the Slurm scheduler says about Kiln's jobs: a submission it refuses, the jobs that still run,
and what ran where: every job and array task, its node, state, start and end.

The scheduler is the record of what ran. `scheduler_records` asks `sacct` where the site keeps
accounting, else `scontrol show job`, which knows a finished job for the cluster's `MinJobAge`
(300 s by default; the local cluster of `kiln slurm up` has no accounting daemon). Kiln reads it as
soon as a job ends and keeps what it read in the stage's folder (`JobJournal`, beside the jobs'
output files), so that a retry, a rerun after a killed driver and `kiln status` need no scheduler
memory, and a job that an earlier driver submitted and that still runs is found and waited for
(`live_jobs`) instead of running its ranks a second time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.launchers import LaunchError

CLIENT_TIMEOUT_S = 60.0  # one sbatch/squeue/sacct/scontrol call
logger = logging.getLogger("kiln.launch.slurm")
JOURNAL_FILE = "slurm_jobs.jsonl"
_FIELD = re.compile(r"(\w+)=(\S*)")
_NO_NODE = ("", "(null)", "None assigned")


class SubmissionRefused(LaunchError, ConfigError):
    """sbatch refused a job (a partition or account the cluster lacks, no SLURM_CONF): the same script is
    refused the same way, so it is never resubmitted; the fix is in the config's cluster section."""

    retryable = False


def run_client(*argv: str) -> subprocess.CompletedProcess:
    """A Slurm client call that never hangs the driver (a controller that does not answer is exit 124)."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"no answer in {CLIENT_TIMEOUT_S:g} s")


def check_slurm_conf() -> None:
    """Refuse at once when SLURM_CONF names no file: every client would retry it for 60 s, then fail."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise SubmissionRefused(f"SLURM_CONF={conf} is not a file, so sbatch cannot reach the cluster: export the "
                                "path of the cluster's slurm.conf (kiln slurm up prints it for a local one)")


def submit(script: Path, *args: str, sbatch: str = "sbatch") -> str:
    """`sbatch --parsable [args] script`; the job's id. A refusal raises `SubmissionRefused`, one line
    with sbatch's own words."""
    check_slurm_conf()
    done = run_client(sbatch, "--parsable", *args, str(script))
    if done.returncode != 0:
        said = "; ".join(line.removeprefix("sbatch: error: ").strip() for line in done.stderr.splitlines()
                         if line.strip()) or "(no message)"
        raise SubmissionRefused(f"sbatch rejected {script} (exit {done.returncode}): {said}. Fix the config's "
                                "cluster section (cluster.partition, cluster.slurm.*) and rerun")
    return done.stdout.strip().split(";")[0]


def live_jobs(job_ids: list[str]) -> list[str]:
    """Those of `job_ids` that the scheduler still has pending or running (any of an array's tasks)."""
    live = []
    for job_id in job_ids:
        done = run_client("squeue", "--noheader", "--jobs", job_id, "--format", "%T")
        if done.returncode == 0 and done.stdout.strip():
            live.append(job_id)
    return live


def job_alive(job_id: str) -> bool | None:
    """Whether the scheduler still has job `job_id` pending or running (None: no Slurm client here, or it
    did not answer): `KeyLock`'s test of an owner that runs inside a Slurm job."""
    try:
        done = run_client("squeue", "--noheader", "--jobs", job_id, "--format", "%T")
    except FileNotFoundError:
        return None
    if done.returncode != 0:  # an unknown job id is an error to squeue: long gone
        return False if "Invalid job id" in done.stderr else None
    return bool(done.stdout.strip())


def wait_for_jobs(job_ids: list[str], what: str, poll_s: float = 2.0) -> None:
    """Wait until none of `job_ids` is pending or running: `what` (an earlier driver's jobs, still working on
    what this run would submit again) must not run twice at once. Says so on the terminal, once."""
    live = live_jobs(job_ids)
    if live:
        logger.warning("%s: Slurm still runs job %s, submitted by a driver that died; waiting for it to end "
                       "(scancel it to stop it)", what, ", ".join(live))
    while live:
        time.sleep(poll_s)
        live = live_jobs(live)


def job_state(job_id: str) -> str:
    """How the scheduler says job `job_id` stands now (`RUNNING`, `CANCELLED`, ...; an array's states
    joined), or `unknown to the scheduler`."""
    try:
        records = scheduler_records(job_id)
    except FileNotFoundError:
        return "unknown: no Slurm client here"
    return ",".join(sorted({r["state"] for r in records})) or "unknown to the scheduler"


def lock_holder(owner: dict[str, Any]) -> str:
    """Who holds a key's lock (`KeyLock.owner()`), for a waiter's message and `kiln status`: its process,
    the Slurm job it runs in and that job's node, the jobs it submitted, each with its state now."""
    text = f"pid {owner.get('pid')} on {owner.get('host')}"
    if owner.get("slurm_job_id"):
        text = (f"Slurm job {owner['slurm_job_id']} on node {owner.get('node')} "
                f"({job_state(owner['slurm_job_id'])}; {text})")
    if owner.get("jobs"):
        text += ", which submitted " + ", ".join(f"job {j} ({job_state(j)})" for j in owner["jobs"])
    return text


def scheduler_records(job_id: str) -> list[dict[str, Any]]:
    """What ran of job `job_id` (every array task of an array job), as the scheduler recorded it:
    `sacct` where accounting is kept, else `scontrol show job`; [] when neither knows it any more."""
    records = _sacct(job_id)
    if records is None:
        records = _scontrol(job_id)
    return sorted(records, key=lambda r: (_task_order(r["task"]), r["job_id"]))


def _sacct(job_id: str) -> list[dict[str, Any]] | None:
    done = run_client("sacct", "--jobs", job_id, "--allocations", "--parsable2", "--noheader",
                      "--format", "JobID,JobIDRaw,State,NodeList,Start,End,ExitCode")
    if done.returncode != 0 or not done.stdout.strip():  # accounting disabled, or the job not in it yet
        return None
    records = []
    for line in done.stdout.splitlines():
        jobid, raw, state, nodes, start, end, exit_code = (line.split("|") + [""] * 7)[:7]
        array, _, task = jobid.partition("_")
        records.append(_record(raw, array if task else None, task or None, state, nodes, start, end, exit_code))
    return records


def _scontrol(job_id: str) -> list[dict[str, Any]]:
    done = run_client("scontrol", "show", "job", "--oneliner", job_id)
    if done.returncode != 0:
        return []
    records = []
    for line in done.stdout.splitlines():
        job = dict(_FIELD.findall(line))
        if "JobId" in job:
            records.append(_record(job["JobId"], job.get("ArrayJobId"), job.get("ArrayTaskId"), job.get("JobState", "?"),
                                   job.get("NodeList", ""), job.get("StartTime", ""), job.get("EndTime", ""),
                                   job.get("ExitCode", "")))
    return records


def _record(job_id: str, array_job_id: str | None, task: str | None, state: str, nodes: str, start: str, end: str,
            exit_code: str) -> dict[str, Any]:
    return {"job_id": job_id, "array_job_id": array_job_id, "task": task, "state": state.split(" ")[0],
            "nodes": hostnames(nodes), "start": _time(start), "end": _time(end), "exit_code": exit_code}


def _time(value: str) -> str | None:
    return None if value in ("", "Unknown", "None", "N/A") else value


def _task_order(task: str | None) -> int:
    digits = re.match(r"\d+", task or "")
    return int(digits.group()) if digits else -1


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (`kiln-n[1-2]`) as node names."""
    if nodelist in _NO_NODE:
        return []
    done = run_client("scontrol", "show", "hostnames", nodelist)
    return done.stdout.split() if done.returncode == 0 and done.stdout.strip() else [nodelist]


class JobJournal:
    """The Slurm jobs a stage submitted, in `{folder}/slurm_jobs.jsonl` (the stage's `logs/`, beside their
    output): each submission as it is made (job, ranks, the driver's host and pid), then what the
    scheduler recorded of it once it ended. Append-only, one JSON object a line, so a driver killed
    between the two leaves its live job named for the next one."""

    def __init__(self, folder: Path, on_submitted: Callable[[str], None] | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / JOURNAL_FILE
        self.on_submitted = on_submitted  # told each job id as it is submitted (the stage's lock records it)

    def __getstate__(self) -> dict[str, Any]:
        # a job's pickled executor carries its journal; the driver's callback (and the lock behind it) stays here
        return {**self.__dict__, "on_submitted": None}

    def submitted(self, job_name: str, job_id: str, ranks: list[int]) -> None:
        self._append({"event": "submitted", "job_name": job_name, "job_id": job_id, "ranks": ranks,
                      "host": socket.gethostname(), "pid": os.getpid(),
                      "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        if self.on_submitted is not None:
            self.on_submitted(job_id)

    def ended(self, job_id: str, tasks: list[dict[str, Any]], **extra: Any) -> None:
        """What the scheduler recorded of job `job_id` (`scheduler_records`), and what Kiln did (`adopted`)."""
        self._append({"event": "ended", "job_id": job_id, "tasks": tasks, **extra})

    def jobs(self, job_name: str | None = None) -> list[dict[str, Any]]:
        """Each submitted job (of `job_name`, or every one), in order, with `tasks` once it ended (else None)."""
        jobs: dict[str, dict[str, Any]] = {}
        for entry in self._entries():
            if entry["event"] == "submitted":
                jobs[entry["job_id"]] = {**entry, "tasks": None}
            elif entry["job_id"] in jobs:
                jobs[entry["job_id"]].update({k: v for k, v in entry.items() if k != "event"})
        return [job for job in jobs.values() if job_name is None or job["job_name"] == job_name]

    def open_jobs(self) -> list[dict[str, Any]]:
        """Submitted jobs whose end is not recorded: the scheduler may still run them."""
        return [job for job in self.jobs() if job["tasks"] is None]

    def _entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        entries = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a killed driver
                continue
        return entries

    def _append(self, entry: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def journal_launch(job_name: str, jobs: list[dict[str, Any]], cpu_s: dict[str, float]) -> dict[str, Any]:
    """The launch record (`cluster.launch_record`'s shape) of a data pipeline's Slurm jobs, retries and
    adopted jobs included: one attempt per job, its array tasks as the scheduler recorded them."""
    attempts = []
    for number, job in enumerate(jobs, 1):
        tasks = job["tasks"] or []
        failed = [t for t in tasks if t["state"] != "COMPLETED"]
        attempts.append({"attempt": number, "job_id": job["job_id"], "ranks": job["ranks"],
                         "nodes": sorted({n for t in tasks for n in t["nodes"]}), "tasks": tasks,
                         "failed": bool(failed) or not tasks,
                         "failed_hosts": sorted({n for t in failed for n in t["nodes"]}),
                         "adopted": bool(job.get("adopted")), "worker_cpu_s": cpu_s.get(job["job_id"], 0.0)})
    return {"launcher": "slurm executor", "job_name": job_name,
            "job_ids": [a["job_id"] for a in attempts], "nodes": sorted({n for a in attempts for n in a["nodes"]}),
            "attempts": attempts, "worker_cpu_s": sum(a["worker_cpu_s"] for a in attempts)}
