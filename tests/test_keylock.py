"""The per-key store lock: exclusive across processes, stale locks of dead owners broken, live ones waited for."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from kiln.tasks.keylock import KeyLock, LockTimeout


def hold(path: str, seconds: float, started) -> None:
    with KeyLock(path):
        started.set()
        time.sleep(seconds)


def test_a_second_process_waits_until_the_first_releases(tmp_path):
    path = tmp_path / "k.lock"
    started = multiprocessing.get_context("spawn").Event()
    owner = multiprocessing.get_context("spawn").Process(target=hold, args=(str(path), 1.5, started))
    owner.start()
    assert started.wait(30)
    waited = []
    begin = time.monotonic()
    with KeyLock(path, on_wait=waited.append):
        held_after = time.monotonic() - begin
    owner.join()
    assert held_after > 0.5 and waited and waited[0]["pid"] == owner.pid
    assert not path.exists()


def test_a_lock_left_by_a_dead_process_on_this_host_is_broken(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "k.lock"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "token": "old"}))
    with KeyLock(path, timeout_s=5) as lock:
        assert lock.owner()["token"] == lock.token


def test_a_live_owner_elsewhere_is_waited_for_and_a_silent_one_is_broken(tmp_path):
    path = tmp_path / "k.lock"
    path.write_text(json.dumps({"host": "another-machine", "pid": 1, "token": "theirs"}))
    with pytest.raises(LockTimeout, match="another-machine"):
        KeyLock(path, timeout_s=0.5, stale_after_s=60).acquire()
    old = time.time() - 120  # no heartbeat for two minutes: that machine died or lost the filesystem
    os.utime(path, (old, old))
    with KeyLock(path, timeout_s=5, stale_after_s=60) as lock:
        assert lock.owner()["token"] == lock.token


def test_the_owner_keeps_its_lock_fresh(tmp_path):
    path = tmp_path / "k.lock"
    with KeyLock(path, heartbeat_s=0.1):
        old = time.time() - 100
        os.utime(path, (old, old))
        time.sleep(0.5)
        assert time.time() - path.stat().st_mtime < 5


def test_the_jobs_a_stage_submits_are_recorded_in_its_lock(tmp_path):
    """A data stage's Slurm journal and a sub-run's recorder tell the stage's lock each job they submit
    (issue 37): a rerun and `kiln status` see which jobs hold the key's work. The journal pickled into
    a job's executor does not carry the driver's lock."""
    import copy

    from kiln.tasks.launch.slurm_jobs import JobJournal
    from kiln.tasks.ledger import StageRecorder, SubRun
    from kiln.tasks.tracker import NullTracker

    with KeyLock(tmp_path / ".k.lock") as lock:
        recorder = StageRecorder(NullTracker(), "run", "clean", "k")
        recorder.lock = lock
        journal = JobJournal(tmp_path / "logs", on_submitted=recorder.job_submitted)
        journal.submitted("kiln_clean", "41", [0, 1])
        _, trial = recorder.subruns(tmp_path).begin(SubRun("trials", "t1", {"lr": 1}))
        trial.job_submitted("42")
        assert lock.owner()["jobs"] == ["41", "42"]
        assert lock.owner()["token"] == lock.token and lock.held()
        assert copy.deepcopy(journal).on_submitted is None
    assert not (tmp_path / ".k.lock").exists()
