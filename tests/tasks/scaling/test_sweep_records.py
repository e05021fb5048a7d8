"""Where sweep trials ran (issue 37, findings 7 and 11), on a real two-node Slurm cluster: each trial's
jobs, nodes, attempts and logs as the scheduler recorded them, in the sweep's manifest (`launch.runs`)
and `kiln status`; a trial whose job was cancelled is resubmitted on its own, and one that failed for
good names its job's log where it lies once the sweep has committed, not in the renamed `.partial` folder."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.tasks.launch.cluster import ClusterSpec, where_it_ran
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.launch.slurm_jobs import scheduler_records
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.scaling.sweep import TRIALS_DIR, TRIALS_FILE, IsoFlopBudget, MixtureDesign, SweepConfig, run_sweep
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials
from kiln.tasks.store import FAILURE_FILE, Store
from kiln.tasks.tracker import NullTracker
from kiln.tasks.train.config import ModelConfig, TrainRunConfig
from tests.conftest import running_slurm

WATCH_S = 240.0

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    with running_slurm(tmp_path_factory.mktemp("slurm2"), cpus=2, nodes=2) as cluster:
        yield cluster


def shards(root: Path) -> dict:
    found: dict = {"dtype": "uint16", "vocab_size": 64, "eos_id": 0, "domains": {}}
    for i, domain in enumerate(("web", "code")):
        rng = np.random.default_rng(i)
        (root / domain).mkdir(parents=True)
        rng.integers(1, 64, 4000).astype("<u2").tofile(root / domain / "train.bin")
        rng.integers(1, 64, 300).astype("<u2").tofile(root / domain / "val.bin")
        found["domains"][domain] = {"train": {"shards": [{"path": f"{domain}/train.bin"}], "num_tokens": 4000},
                                    "val": {"shards": [{"path": f"{domain}/val.bin"}]}}
    return found


def small_sweep() -> SweepConfig:
    """3 first-phase trials (widths 4 and 8 at one budget, a mixture trial), then one LR trial."""
    return SweepConfig(
        model=ModelConfig(d_model=8, n_layers=1, n_heads=2, max_seq_len=16), lr=3e-3,
        isoflop=[IsoFlopBudget(flops=1e7, widths=[4, 8])], lr_multipliers=[1.0, 2.0],
        mixtures={"u": {"web": 1, "code": 1}}, mixture_design=MixtureDesign(num_samples=0, width=20), max_parallel=2,
        run=TrainRunConfig(steps=10, batch_size=4, seq_len=16, eval_batches=1, checkpoint_every=5))


def test_sweep_trials_record_their_jobs_nodes_attempts_and_committed_logs(two_nodes, tmp_path):
    """Share 0's first-phase job is scancelled twice (its submission and its one resubmission): its
    unfinished trials fail after two jobs, the others train; every trial's record names its jobs as the
    scheduler saw them and logs that exist in the committed sweep folder."""
    store = Store(tmp_path / "store")
    out = store.begin("sweep", "k", resumable=True)
    final = store.path("sweep", "k")
    cancelled: list[str] = []
    stop = threading.Event()

    def scancel_share_0() -> None:
        deadline = time.monotonic() + WATCH_S
        while not stop.is_set() and time.monotonic() < deadline and len(cancelled) < 2:
            queued = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i %j"],
                                    capture_output=True, text=True).stdout.splitlines()
            job = next((line.split()[0] for line in queued if line.endswith("kiln-sweep-phase1-0")), None)
            if job is not None and job not in cancelled:
                subprocess.run(["scancel", job], check=True)
                cancelled.append(job)
            time.sleep(0.05)

    watcher = threading.Thread(target=scancel_share_0, daemon=True)
    watcher.start()
    recorder = StageRecorder(NullTracker(), "run", "sweep", "k")
    where = JobTrials("slurm", ClusterSpec(rdzv_port=free_port(), max_restarts=1), 2, out / JOBS_DIR,
                      committed_dir=final / JOBS_DIR)
    try:
        results = run_sweep(small_sweep(), shards(tmp_path / "tokenize"), tmp_path / "tokenize",
                            SubRuns(recorder, out), where=where, committed_as=final)
    finally:
        stop.set()
        watcher.join()
    assert len(cancelled) == 2, cancelled
    store.commit("sweep", "k", {"launch": {"runs": recorder.launches}})

    by_name = {r.name: r for r in results}
    assert sorted(recorder.launches) == sorted(f"{TRIALS_DIR}/{name}" for name in by_name)
    failed = sorted(r.name for r in results if r.status == "failed")
    assert failed and len(failed) < len(results)  # share 0's unfinished trials; the others trained
    for run, record in recorder.launches.items():
        name = run.split("/", 1)[1]
        assert record["launcher"] == "slurm" and record["nodes"] and set(record["nodes"]) <= {"kiln-n1", "kiln-n2"}
        for attempt in record["attempts"]:
            assert attempt["tasks"] and attempt["tasks"][0]["job_id"] == attempt["job_id"]
            assert attempt["nodes"] == attempt["tasks"][0]["nodes"]
            log = Path(attempt["log"])
            assert ".partial" not in str(log) and log.is_file() and log.is_relative_to(final / JOBS_DIR)
        if name in failed:  # both of its jobs were the cancelled ones, and each failed it
            assert record["job_ids"] == cancelled
            assert [(a["state"], a["failed"]) for a in record["attempts"]] == [("CANCELLED", True)] * 2
            assert record["attempts"][0]["failed_hosts"] == []  # a cancel blames no node
        else:  # one job, which completed it (or was cancelled only after it committed the trial)
            assert [a["failed"] for a in record["attempts"]] == [False]
            assert record["worker_cpu_s"] > 0
        # the trial's own record says the Slurm node, not this host's name
        if name not in failed:  # (a cancelled job may have ended before its trial began)
            attempts = (final / TRIALS_DIR / name / "attempts.jsonl").read_text().splitlines()
            assert {json.loads(line)["node"] for line in attempts} <= {"kiln-n1", "kiln-n2"}

    # a failed trial's reason names its last job's log where it lies now, in trials.json and its failure record
    rows = {row["name"]: row for row in json.loads((final / TRIALS_FILE).read_text())}
    for name in failed:
        log = final / JOBS_DIR / "phase1-0" / f"kiln-sweep-phase1-0-{cancelled[1]}.out"
        assert f"log: {log}" in rows[name]["reason"] and log.is_file()
        record = json.loads((final / TRIALS_DIR / f".{name}.partial" / FAILURE_FILE).read_text())
        assert f"log: {log}" in record["message"] and ".partial/jobs" not in record["message"]

    # kiln status: a line per trial with its jobs and nodes, the cancelled attempts, each job and its log
    lines = where_it_ran(store.manifest("sweep", "k")["launch"])
    first = failed[0]
    head = next(line for line in lines if line.startswith(f"{TRIALS_DIR}/{first}: slurm job {','.join(cancelled)} "))
    assert f"attempt 1 failed (job {cancelled[0]} CANCELLED); attempt 2 failed (job {cancelled[1]} CANCELLED)" in head
    assert any(line.startswith(f"  job {cancelled[0]}: ran CANCELLED on kiln-n") for line in lines), lines
    assert sum(line.startswith("    log: ") for line in lines) == sum(len(r["attempts"])
                                                                      for r in recorder.launches.values())


def test_a_sweep_waits_for_an_earlier_driver_s_live_job_before_submitting_its_own(two_nodes, tmp_path, caplog):
    """A job the stage's previous (dead) driver submitted may still train these trials: the sweep submits
    nothing until the scheduler says it has ended, so no trial is trained by two jobs at once."""
    earlier = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/earlier-%j.out", "--wrap", "sleep 15"],
                             capture_output=True, text=True, check=True).stdout.strip()
    recorder = StageRecorder(NullTracker(), "run", "sweep", "k")
    where = JobTrials("slurm", ClusterSpec(rdzv_port=free_port(), max_restarts=0), 2, tmp_path / "out" / JOBS_DIR,
                      earlier_jobs=[earlier])
    sweep = small_sweep().model_copy(update={"isoflop": [IsoFlopBudget(flops=1e7, widths=[4])]})
    with caplog.at_level("WARNING", logger="kiln.launch.slurm"):
        results = run_sweep(sweep, shards(tmp_path / "tokenize"), tmp_path / "tokenize",
                            SubRuns(recorder, tmp_path / "out"), where=where)
    assert all(r.ok for r in results)
    assert any(f"Slurm still runs job {earlier}, submitted by a driver that died; waiting" in r.getMessage()
               for r in caplog.records), caplog.text
    (ended,) = [t["end"] for t in scheduler_records(earlier)]
    starts = [a["tasks"][0]["start"] for r in recorder.launches.values() for a in r["attempts"]]
    assert starts and all(start >= ended for start in starts)  # ISO times: none began before it ended
