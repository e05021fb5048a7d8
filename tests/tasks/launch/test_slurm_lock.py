"""A stage's lock held from inside a Slurm job (issue 37): the lock names the job and its node, a
waiter and `kiln status` say so with the job's state as the scheduler gives it, and once the
scheduler says the job has ended the lock is stale at once, wherever its process ran."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.flows.cli import _stage_state
from kiln.tasks.keylock import KeyLock, LockTimeout
from kiln.tasks.launch.slurm_jobs import job_alive, job_state, lock_holder
from kiln.tasks.stages import REGISTRY
from kiln.tasks.store import Store

HOLD = """
import sys, time
from pathlib import Path
from kiln.tasks.keylock import KeyLock
lock = KeyLock(Path(sys.argv[1]))
lock.acquire()
lock.add_jobs(["4242"])  # a job it submitted (long gone: the scheduler does not know it)
Path(sys.argv[2]).write_text("held")
time.sleep(600)
"""


def wait_for(what, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout_s} s for {what}")


@pytest.mark.timeout(300)
def test_a_lock_held_in_a_slurm_job_names_the_job_its_node_and_whether_it_runs(slurm_two_nodes, tmp_path, caplog):
    store = Store(tmp_path / "store")
    path = store.lock("clean", "k").path
    path.parent.mkdir(parents=True)
    script, ready = tmp_path / "hold.py", tmp_path / "ready"
    script.write_text(HOLD)
    job = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/hold-%j.out", "--wrap",
                          f"{sys.executable} {script} {path} {ready}"], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        wait_for(ready.is_file)
        owner = KeyLock(path).owner()
        assert owner["slurm_job_id"] == job and owner["node"] in {"kiln-n1", "kiln-n2"}
        assert owner["host"] == socket.gethostname() and owner["jobs"] == ["4242"]
        held_by = (f"Slurm job {job} on node {owner['node']} (RUNNING; pid {owner['pid']} on {owner['host']}), "
                   "which submitted job 4242 (unknown to the scheduler)")
        assert lock_holder(owner) == held_by

        # a second run waits, and says who it waits for
        seen = []
        with pytest.raises(LockTimeout):
            KeyLock(path, timeout_s=1.0, on_wait=lambda o: seen.append(lock_holder(o)), job_alive=job_alive).acquire()
        assert seen == [held_by]
        store.begin("clean", "k")  # kiln status: the stage is running, held by that job
        assert _stage_state(store, REGISTRY["clean"], "k", 300) == (f"running (held by {held_by})", {})

        # the same record on another machine: the heartbeat alone cannot tell it is gone; the scheduler can
        elsewhere = {**owner, "host": "another-machine"}
        path.write_text(json.dumps(elsewhere))
        assert KeyLock(path, job_alive=job_alive).held()
    finally:
        subprocess.run(["scancel", job], check=True)
    wait_for(lambda: job_alive(job) is False)
    assert job_state(job) == "CANCELLED"
    assert KeyLock(path).held()  # fresh heartbeat, owner on "another machine": only the scheduler knows
    assert not KeyLock(path, job_alive=job_alive).held()
    assert lock_holder(elsewhere).startswith(f"Slurm job {job} on node {owner['node']} (CANCELLED; ")
    with KeyLock(path, job_alive=job_alive, timeout_s=5.0):  # broken at once, no 60 s wait
        pass


@pytest.mark.timeout(300)
def test_a_rerun_after_a_dead_driver_knows_the_jobs_its_lock_named_that_still_run(
        slurm_two_nodes, tmp_path, monkeypatch, caplog):
    """The driver that held a stage's lock was killed (its pid is gone) while a job it submitted still
    runs: the rerun breaks the stale lock and, from the jobs the lock named, knows which the scheduler
    still runs (a stage that launches jobs waits for them: JobTrials) and says so; the ended ones it leaves."""
    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.runner import run_pipeline
    from kiln.tasks.stage import Registry
    from kiln.tasks.stages import collect as collect_stage
    from tests.fixtures import toy_stage

    repo = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo)
    registry = Registry([collect_stage.STAGE, toy_stage.STAGE])
    cfg = load_config("tests/fixtures/toy.yaml", [f"work_dir={tmp_path}"], registry=registry)
    key = stage_keys(cfg, registry)["toy-count"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/sleep-%j.out", "--wrap", "sleep 120"],
                          capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_for(lambda: job_alive(live))
        lock = Store(cfg.store_root).lock("toy-count", key).path
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "token": "dead", "since": 0,
                                    "jobs": ["4242", live]}))
        with caplog.at_level("WARNING", logger="kiln.tasks.runner"):
            assert [o.status for o in run_pipeline(cfg, registry=registry)] == ["ran", "ran"]
        said = [r.getMessage() for r in caplog.records if "is gone, but Slurm still runs" in r.getMessage()]
        assert said == [f"stage toy-count/{key}: the driver that held it (pid {dead.pid} on {socket.gethostname()}) "
                        f"is gone, but Slurm still runs its jobs {live}"]
    finally:
        subprocess.run(["scancel", live], check=True)
