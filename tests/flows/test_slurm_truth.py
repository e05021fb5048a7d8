"""A Slurm user's week (issue 37), on the real local Slurm cluster: a data stage's jobs as the scheduler
saw them, a resubmission said on the terminal, logs kept in the committed stage, a refused submission as
one line that is never retried, and a driver killed while its job runs: the job is named by `kiln status`
and adopted by the rerun, never run twice."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.data.executors import ExecutorError
from kiln.tasks.graph import stage_keys
from kiln.tasks.launch.slurm_jobs import JOURNAL_FILE, JobJournal
from kiln.tasks.runner import run_stage
from kiln.tasks.store import Store
from tests.processes import kill_tree

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

TINY = "configs/tiny.yaml"
# two shards: clean runs two ranks, one array task each
SMALL = ["clean.num_workers=2", "clean.quality_training=null", "clean.quality_top_fraction=null",
         "collect.max_docs_per_source=4", "collect.shard_bytes=250000"]


def _overrides(tmp_path: Path, *more: str) -> list[str]:
    return [f"work_dir={tmp_path}", "cluster.executor=slurm", *SMALL, *more]


def _squeue(*args: str) -> list[list[str]]:
    done = subprocess.run(["squeue", "--noheader", *args], capture_output=True, text=True, check=True)
    return [line.split() for line in done.stdout.splitlines() if line.strip()]


def _collected(tmp_path: Path, *more: str):
    cfg = load_config(TINY, _overrides(tmp_path, *more))
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    run_stage("collect", cfg, store=store, keys=keys)
    return cfg, store, keys


def test_a_data_stage_records_every_job_and_task_as_slurm_saw_them_and_keeps_their_logs(
        slurm_cluster, in_repo, tmp_path, caplog, capsys):
    cfg, store, keys = _collected(tmp_path)
    cancelled: list[str] = []

    partial_logs = store.partial_path("clean", keys["clean"]).resolve() / "logs"

    def scancel_rank_1() -> None:  # the array's second task, once its rank runs: as a person's scancel would
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not cancelled:
            for task, state in _squeue("--name", f"kiln-clean-{keys['clean'][:12]}-clean", "--array", "--format", "%i %T"):
                out = partial_logs / f"{task}.out"
                if task.endswith("_1") and state == "RUNNING" and out.is_file() and "srun" in out.read_text():
                    subprocess.run(["scancel", task], check=True)
                    cancelled.append(task)
            time.sleep(0.1)

    canceller = threading.Thread(target=scancel_rank_1)
    canceller.start()
    try:
        with pytest.raises(ExecutorError) as failed:
            run_stage("clean", cfg, store=store, keys=keys)
    finally:
        canceller.join()
    assert cancelled, "the second array task was never seen running"
    first = cancelled[0].split("_")[0]
    message = str(failed.value)
    assert "1 of 2 ranks did not finish" in message
    assert f"Slurm output {partial_logs / f'{first}_1.out'}" in message  # the stage's logs/<job>_<task>.out
    assert f"Slurm job {first} task 1 CANCELLED on {slurm_cluster.node}" in message  # the scheduler's word

    with caplog.at_level(logging.WARNING, logger="kiln.data.executors"):
        assert run_stage("clean", cfg, store=store, keys=keys).status == "ran"
    (said,) = [r.getMessage() for r in caplog.records if r.name == "kiln.data.executors"]
    assert said.startswith(f"kiln_clean: resubmitting ranks 1 of Slurm job {first}: task 1 CANCELLED on "
                           f"{slurm_cluster.node} "), said

    manifest = store.manifest("clean", keys["clean"])
    record = manifest["launch"]["runs"]["kiln_clean"]
    assert record["launcher"] == "slurm executor" and record["job_ids"][0] == first and len(record["job_ids"]) == 2
    second = record["job_ids"][1]
    assert [(a["job_id"], a["ranks"], [(t["task"], t["state"], t["nodes"]) for t in a["tasks"]], a["failed"])
            for a in record["attempts"]] == [
        (first, [0, 1], [("0", "COMPLETED", [slurm_cluster.node]), ("1", "CANCELLED", [slurm_cluster.node])], True),
        (second, [1], [("0", "COMPLETED", [slurm_cluster.node])], False)]
    assert all(t["start"] and t["end"] for a in record["attempts"] for t in a["tasks"])
    # the ranks' CPU seconds, once: the launch block's and stats.json's agree
    assert record["worker_cpu_s"] == pytest.approx(manifest["stats"]["executor_cpu_s"]) and record["worker_cpu_s"] > 0
    assert manifest["cost"]["executor_cpu_s"] == manifest["stats"]["executor_cpu_s"]

    logs = store.path("clean", keys["clean"]) / "logs"  # committed with the stage, every job's output
    assert {p.name for p in logs.glob("*.out")} == {f"{first}_0.out", f"{first}_1.out", f"{second}_0.out"}
    assert len(list(logs.glob("kiln_clean.*.sbatch"))) == 2 and (logs / JOURNAL_FILE).is_file()

    capsys.readouterr()
    assert main(["status", TINY, *_overrides(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"kiln_clean: slurm executor job {first},{second} (kiln_clean)" in out
    assert f"attempt 1 failed on {slurm_cluster.node}" in out
    assert f"job {first}, ranks 0,1: task 0 COMPLETED on {slurm_cluster.node}" in out
    assert f"task 1 CANCELLED on {slurm_cluster.node}" in out
    assert f"job {second}, ranks 1: task 0 COMPLETED on {slurm_cluster.node}" in out


def test_a_killed_driver_s_live_job_is_named_by_status_and_adopted_by_the_rerun(
        slurm_cluster, in_repo, tmp_path, caplog, capsys):
    cfg, store, keys = _collected(tmp_path)
    # every CPU of the node taken: the clean job waits PENDING while its driver is killed
    blocker = subprocess.run(["sbatch", "--parsable", f"--cpus-per-task={slurm_cluster.cpus}", "--job-name=blocker",
                              "--output=/dev/null", "--wrap", "sleep 600"], capture_output=True, text=True,
                             check=True).stdout.strip()
    driver = None
    try:
        journal = store.partial_path("clean", keys["clean"]) / "logs" / JOURNAL_FILE
        driver = subprocess.Popen([sys.executable, "-c", (
            "from kiln.tasks.config import load_config; from kiln.tasks.runner import run_stage; "
            f"run_stage('clean', load_config({TINY!r}, {_overrides(tmp_path)!r}))")], env=os.environ.copy())
        deadline = time.monotonic() + 180
        while not journal.is_file() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        assert journal.is_file(), "the driver never submitted its job"
        kill_tree(driver.pid)  # SIGKILL, as when its machine dies
        driver.wait()
        (job,) = JobJournal(journal.parent).jobs()
        assert _squeue("--jobs", job["job_id"], "--format", "%i")  # it outlives its driver

        capsys.readouterr()
        assert main(["status", TINY, *_overrides(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert (f"partial, its driver gone but Slurm still runs job {job['job_id']} (kiln_clean ranks 0,1, "
                f"submitted by pid {driver.pid}") in out, out
    finally:
        subprocess.run(["scancel", blocker], check=True)
        if driver is not None and driver.poll() is None:
            kill_tree(driver.pid)

    with caplog.at_level(logging.WARNING, logger="kiln.data.executors"):
        assert run_stage("clean", cfg, store=store, keys=keys).status == "ran"
    assert any(f"Slurm job {job['job_id']} (ranks 0,1), submitted by pid {driver.pid}" in r.getMessage()
               and "still runs: waiting for it" in r.getMessage() for r in caplog.records), caplog.text
    committed = store.path("clean", keys["clean"]) / "logs"
    submitted = [json.loads(line) for line in (committed / JOURNAL_FILE).read_text().splitlines()
                 if json.loads(line)["event"] == "submitted"]
    assert [s["job_id"] for s in submitted] == [job["job_id"]]  # never a second job for the same ranks
    record = store.manifest("clean", keys["clean"])["launch"]["runs"]["kiln_clean"]
    assert record["job_ids"] == [job["job_id"]] and record["attempts"][0]["adopted"]
    assert [t["state"] for t in record["attempts"][0]["tasks"]] == ["COMPLETED", "COMPLETED"]


def test_a_refused_data_submission_is_one_line_never_retried_and_says_fix_the_config(
        prefect_api, slurm_cluster, in_repo, tmp_path, capfd, monkeypatch):
    calls = tmp_path / "sbatch-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "sbatch"  # the real sbatch, each call counted
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexec /usr/bin/sbatch \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    overrides = _overrides(tmp_path, "cluster.partition=gpu", "orchestration.retries=1",
                           "orchestration.retry_delay_seconds=0")

    assert main(["run", TINY, *overrides, "--until", "clean"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CalledProcessError" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("kiln: error:")]
    assert line.startswith("kiln: error: sbatch rejected ") and "invalid partition specified: gpu" in line, line
    assert len(calls.read_text().splitlines()) == 1  # never retried

    assert main(["status", TINY, *overrides]) == 0
    out = capfd.readouterr().out
    assert "failed (fix the config, then rerun): SubmissionRefused: sbatch rejected" in out, out


def test_a_killed_driver_s_job_that_ends_before_the_rerun_is_its_record_and_the_lock_named_it(
        slurm_cluster, in_repo, tmp_path):
    """The driver is killed while its job runs, and the job finishes before anyone reruns: the lock the
    dead driver left names the job (and `kiln status` with it), and the rerun records that job, not `runs {}`,
    and submits nothing."""
    from kiln.tasks.keylock import KeyLock

    cfg, store, keys = _collected(tmp_path)
    journal = store.partial_path("clean", keys["clean"]) / "logs" / JOURNAL_FILE
    driver = subprocess.Popen([sys.executable, "-c", (
        "from kiln.tasks.config import load_config; from kiln.tasks.runner import run_stage; "
        f"run_stage('clean', load_config({TINY!r}, {_overrides(tmp_path)!r}))")], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 180
        while not journal.is_file() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        assert journal.is_file(), "the driver never submitted its job"
    finally:
        kill_tree(driver.pid)  # SIGKILL, as when its machine dies
        driver.wait()
    (job,) = JobJournal(journal.parent).jobs()
    lock = store.lock("clean", keys["clean"])
    assert lock.owner()["pid"] == driver.pid and lock.owner()["jobs"] == [job["job_id"]]
    deadline = time.monotonic() + 300
    while _squeue("--jobs", job["job_id"], "--format", "%i") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _squeue("--jobs", job["job_id"], "--format", "%i"), "the job did not end"
    assert not KeyLock(lock.path).held()  # its pid is gone

    assert run_stage("clean", cfg, store=store, keys=keys).status == "ran"
    committed = store.path("clean", keys["clean"]) / "logs"
    submitted = [json.loads(line) for line in (committed / JOURNAL_FILE).read_text().splitlines()
                 if json.loads(line)["event"] == "submitted"]
    assert [s["job_id"] for s in submitted] == [job["job_id"]]  # nothing ran twice
    record = store.manifest("clean", keys["clean"])["launch"]["runs"]["kiln_clean"]
    assert record["job_ids"] == [job["job_id"]] and not record["attempts"][0]["adopted"]
    assert [t["state"] for t in record["attempts"][0]["tasks"]] == ["COMPLETED", "COMPLETED"]
    assert sorted(p.name for p in committed.glob("*.out")) == [f"{job['job_id']}_0.out", f"{job['job_id']}_1.out"]
