"""A sweep on the real single-node Slurm cluster: its 16 trials run as Slurm jobs, at most `max_parallel`
at once; a job whose program is killed mid-trial (a lost node, preemption) reruns only the trial it was
training (resumed from its folder);
and the fit's inputs are the in-process sweep's, number for number. A job Slurm refuses is not retried."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from kiln.tasks.errors import is_retryable
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.launchers import LaunchError
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.scaling.sweep import (
    TRIALS_DIR,
    TRIALS_FILE,
    IsoFlopBudget,
    MixtureDesign,
    SweepConfig,
    load_trials,
    run_sweep,
)
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, PoolTrials
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker
from kiln.tasks.train.config import ModelConfig, TrainRunConfig
from tests.processes import argv

MAX_PARALLEL = 2
# how long the watcher waits for a trial to be training inside a job before it gives up (a slow machine)
WATCH_S = 240.0

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]  # Slurm jobs on a busy machine


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("tokenize")
    shards: dict = {"dtype": "uint16", "vocab_size": 64, "eos_id": 0, "domains": {}}
    for i, domain in enumerate(("web", "code")):
        rng = np.random.default_rng(i)
        (root / domain).mkdir()
        rng.integers(1, 64, 6000).astype("<u2").tofile(root / domain / "train.bin")
        rng.integers(1, 64, 300).astype("<u2").tofile(root / domain / "val.bin")
        shards["domains"][domain] = {"train": {"shards": [{"path": f"{domain}/train.bin"}], "num_tokens": 6000},
                                     "val": {"shards": [{"path": f"{domain}/val.bin"}]}}
    return shards, root


def sweep_config() -> SweepConfig:
    """16 trials: 3 budgets x 4 widths, a mixture trial, then LR x 2 at each budget's best width. A
    checkpoint every 10 steps, so a killed trial resumes mid-way."""
    return SweepConfig(
        model=ModelConfig(d_model=8, n_layers=1, n_heads=2, max_seq_len=16), lr=3e-3,
        isoflop=[IsoFlopBudget(flops=f, widths=[4, 8, 12, 16]) for f in (1e7, 2e7, 4e7)],
        lr_multipliers=[1.0, 2.0], mixtures={"u": {"web": 1, "code": 1}},
        mixture_design=MixtureDesign(num_samples=0, width=20), max_parallel=MAX_PARALLEL,
        run=TrainRunConfig(steps=20, batch_size=4, seq_len=16, eval_batches=1, checkpoint_every=10))


def fit_inputs(path: Path) -> list[dict]:
    """trials.json as the fit reads it, without the wall times (the only field that may differ)."""
    return [{k: v for k, v in asdict(trial).items() if k != "wall_s"} for trial in load_trials(path)]


def subruns(out: Path) -> SubRuns:
    return SubRuns(StageRecorder(NullTracker(), "run", "sweep", "k"), out)


def kill_a_running_trial(out: Path, killed: list[tuple[str, str]], stop: threading.Event) -> None:
    """Once a trial of a first-phase job has trained some steps (a complete checkpoint in its folder, not
    yet committed), SIGKILL that job's program, as a lost node or a preemption would end it (a user's
    `scancel` is retried the same way: test_a_scancelled_trial_job_...); record (job id, trial)."""
    trials = out / TRIALS_DIR
    deadline = time.monotonic() + WATCH_S
    while not stop.is_set() and time.monotonic() < deadline:
        for folder in trials.glob(".*.partial"):
            if any(folder.glob("checkpoints/step_*/COMPLETE")) and folder.is_dir():  # committed: moved
                trial = folder.name[1:-len(".partial")]
                queued = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i %j"],
                                        capture_output=True, text=True).stdout.splitlines()
                share = _share_of(out, trial)
                job = next((line.split()[0] for line in queued if line.endswith(f"kiln-sweep-phase1-{share}")), None)
                program = _job_program(job) if job else None
                if program is None:
                    continue
                os.kill(program, signal.SIGKILL)
                killed.append((job, trial))
                return
        time.sleep(0.05)


def _job_program(job: str) -> int | None:
    """The pid of the trial runner inside Slurm job `job` (its step's Python program, not srun or the shell)."""
    listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True).stdout.splitlines()[1:]
    pids = [int(line.split()[0]) for line in listed if line.split() and int(line.split()[0]) > 0]
    return next((pid for pid in pids if "kiln.tasks.scaling.trial_runs" in argv(pid)), None)


def _share_of(out: Path, trial: str) -> int | None:
    for share in range(MAX_PARALLEL):
        job = out / JOBS_DIR / f"phase1-{share}" / "job.json"
        if job.is_file() and any(e["trial"]["name"] == trial for e in json.loads(job.read_text())["shares"][0]):
            return share
    return None


def concurrent_jobs(jobcomp: Path) -> int:
    """The most jobs running at once, from Slurm's completion log (whole-second start and end times)."""
    spans = []
    for line in jobcomp.read_text().splitlines():
        fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
        if fields.get("Name", "").startswith("kiln-sweep-"):
            spans.append((fields["StartTime"], fields["EndTime"]))
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])  # an end before a start
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def test_a_slurm_sweep_runs_max_parallel_jobs_reruns_only_a_killed_trial_and_fits_the_same(
        shards, slurm_cluster, tmp_path):
    local = tmp_path / "local"
    results = run_sweep(sweep_config(), *shards, subruns(local), where=PoolTrials(MAX_PARALLEL))
    assert len(results) == 16 and all(r.ok for r in results)

    out = tmp_path / "slurm"
    killed: list[tuple[str, str]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=kill_a_running_trial, args=(out, killed, stop), daemon=True)
    watcher.start()
    where = JobTrials("slurm", ClusterSpec(rdzv_port=free_port(), max_restarts=1), MAX_PARALLEL, out / JOBS_DIR)
    try:
        run_sweep(sweep_config(), *shards, subruns(out), where=where)
    finally:
        stop.set()
        watcher.join()
    assert killed, "no trial was seen training inside a Slurm job"
    job, trial = killed[0]

    # the fit reads the same numbers, the killed trial's (resumed from a checkpoint) included
    assert fit_inputs(out / TRIALS_FILE) == fit_inputs(local / TRIALS_FILE)
    store = Store(out)
    launches = {r.name: store.manifest(TRIALS_DIR, r.name)["launch"] for r in results}
    assert {launch["launcher"] for launch in launches.values()} == {"slurm"}
    jobs = {name: [a["job_id"] for a in launch["attempts"]] for name, launch in launches.items()}
    retrained = {name: ids for name, ids in jobs.items() if len(ids) > 1}
    # only a trial begun in the killed job trained again, in its share's resubmission; the one seen
    # mid-way with a checkpoint resumed from it (the kill can also land as a trial commits, between two)
    assert len(retrained) <= 1 and all(ids[0] == job for ids in retrained.values())
    if trial in retrained:
        assert json.loads((out / TRIALS_DIR / trial / "metrics.json").read_text())["resumed_from_step"] >= 10
    # every trial trained in a Slurm job, at most MAX_PARALLEL at once: 2 shares a phase, plus the
    # resubmission when the killed job still had a trial to finish
    assert len({i for ids in jobs.values() for i in ids}) == 4 + bool(retrained)
    assert concurrent_jobs(slurm_cluster.folder / "log" / "jobcomp.txt") <= MAX_PARALLEL


def test_a_sweep_job_slurm_refuses_is_not_retried_and_says_why(shards, slurm_cluster, tmp_path):
    """sbatch refuses a partition the cluster lacks: no retry can cure that, so nothing is resubmitted."""
    where = JobTrials("slurm", ClusterSpec(partition="no-such-partition", max_restarts=2), MAX_PARALLEL,
                      tmp_path / JOBS_DIR)
    with pytest.raises(LaunchError, match=r"sbatch rejected .*(?i:invalid partition)") as refused:
        run_sweep(sweep_config(), *shards, subruns(tmp_path), where=where)
    assert not is_retryable(refused.value)
    assert not list(tmp_path.glob(f"{JOBS_DIR}/*/*.out"))  # no job ever ran
    assert not Store(tmp_path).is_complete(TRIALS_DIR, "w4-lr0.003-bs4-s73-u")


def test_a_scancelled_trial_job_is_retried_on_its_own_and_the_sweep_goes_on(shards, slurm_cluster, tmp_path, caplog):
    """A person's scancel (or a preemption) of one share's job is that job's trials' failure (issue 37): its
    unfinished trials are resubmitted alone, the other share's job is left running, and the sweep ends with
    every trial trained."""
    out = tmp_path / "slurm"
    cancelled: list[str] = []
    stop = threading.Event()

    def scancel_share_0() -> None:
        deadline = time.monotonic() + WATCH_S
        while not stop.is_set() and time.monotonic() < deadline and not cancelled:
            if any(folder.is_dir() for folder in (out / TRIALS_DIR).glob(".*.partial")):  # a trial is training
                queued = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i %j"],
                                        capture_output=True, text=True).stdout.splitlines()
                job = next((line.split()[0] for line in queued if line.endswith("kiln-sweep-phase1-0")), None)
                if job is not None:
                    subprocess.run(["scancel", job], check=True)
                    cancelled.append(job)
            time.sleep(0.05)

    watcher = threading.Thread(target=scancel_share_0, daemon=True)
    watcher.start()
    where = JobTrials("slurm", ClusterSpec(rdzv_port=free_port(), max_restarts=1), MAX_PARALLEL, out / JOBS_DIR)
    try:
        with caplog.at_level("WARNING", logger="kiln.sweep"):
            results = run_sweep(sweep_config(), *shards, subruns(out), where=where)
    finally:
        stop.set()
        watcher.join()
    assert cancelled, "no first-phase job was seen running"
    assert len(results) == 16 and all(r.ok for r in results), [(r.name, r.status, r.reason) for r in results]
    assert any("sweep job phase1-0 was cancelled; resubmitting it for its unfinished trials" in r.getMessage()
               for r in caplog.records), caplog.text
    jobcomp = (slurm_cluster.folder / "log" / "jobcomp.txt").read_text().splitlines()
    ended = {fields["JobId"]: fields["JobState"] for fields in
             (dict(f.split("=", 1) for f in line.split() if "=" in f) for line in jobcomp)
             if fields.get("Name", "").startswith("kiln-sweep-phase1-")}
    assert ended[cancelled[0]] == "CANCELLED"
    assert list(ended.values()).count("CANCELLED") == 1  # the other share's job was not taken down with it
