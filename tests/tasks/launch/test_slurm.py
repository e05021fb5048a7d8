"""The Slurm launcher on a real two-node Slurm cluster: a failed job is followed to its end with its
log streamed and raises with its state, SIGTERM to the waiting process cancels the job, and the
exclusion policy for failed hosts. (A job that completes: tests/tasks/launch/test_slurm_training.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.launchers import record_failed_hosts
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.launch.slurm import Exclusion, SlurmJobFailed, SlurmLauncher, plan_exclusion

REPO = Path(__file__).resolve().parents[3]
# each rank says where it runs; rank 1 fails when asked to
RANK_SCRIPT = """
import os, sys
print(f"rank {os.environ['RANK']} on {os.environ['SLURMD_NODENAME']}", flush=True)
sys.exit(3 if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1" else 0)
"""
WAIT_ON_A_JOB = """
import sys
from pathlib import Path
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.slurm import SlurmLauncher
SlurmLauncher(ClusterSpec(rdzv_port=int(sys.argv[2])), Path(sys.argv[1]), job_name="kiln-cancel").launch([sys.argv[3]])
"""


def test_exclusion_policy():
    two = {"n1": "idle", "n2": "mixed"}
    four = {"n1": "idle", "n2": "allocated", "n3": "idle", "n4": "down*"}
    known = {"n1", "n2", "n3", "n4", "n5"}
    # room enough: the failed and the configured hosts are excluded
    assert plan_exclusion(1, [], ["n1"], two, known) == Exclusion(("n1",))
    assert plan_exclusion(1, ["n2"], ["n1"], four, known) == Exclusion(("n1", "n2"))
    # a down node does not count: excluding n1 leaves n2, n3 for a 3-node job, so n1 is used again
    assert plan_exclusion(3, [], ["n1"], four, known) == Exclusion((), dropped=("n1",))
    # the configured exclusion always holds, even when the job cannot then run (the user's word)
    assert plan_exclusion(2, ["n2"], ["n1"], two, known) == Exclusion(("n2",), dropped=("n1",))
    # a name that is no node (a hostname from a torchrun summary) would make sbatch refuse the job
    assert plan_exclusion(1, [], ["vm.local", "n1"], two, known) == Exclusion(("n1",), unknown=("vm.local",))
    # sinfo could not say: exclude what was asked
    assert plan_exclusion(2, ["n2"], ["n1"], None, None) == Exclusion(("n1", "n2"))


def test_a_cpu_job_asks_for_a_cpu_per_process(tmp_path):
    script = SlurmLauncher(ClusterSpec(nodes=2), tmp_path, nproc_per_node=3).render(["-m", "x"])
    assert "#SBATCH --cpus-per-task=3\n" in script and "--gpus-per-node" not in script
    assert "srun --kill-on-bad-exit=1 --cpus-per-task=3 " in script  # srun 22.05 does not inherit it


def test_a_failed_job_over_both_nodes_raises_with_its_state_and_streamed_log(slurm_two_nodes, tmp_path, caplog):
    """Two nodes, one process each; rank 1 exits 3. kiln-n1 is recorded as failed, but without it
    the job could not run: it is submitted onto it anyway, and the launcher says so."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    failed = tmp_path / "failed_hosts.json"
    record_failed_hosts(failed, ["kiln-n1"])
    launcher = SlurmLauncher(ClusterSpec(nodes=2, rdzv_port=free_port()), tmp_path / "out", nproc_per_node=1,
                             env={"OMP_NUM_THREADS": "1"}, failed_hosts_file=failed, workdir=tmp_path)
    with caplog.at_level(logging.INFO, logger="kiln.launch.slurm"), pytest.raises(SlurmJobFailed) as raised:
        launcher.launch([str(script), "fail"])
    assert launcher.excluded == [] and launcher.exclusion_dropped == ["kiln-n1"]
    assert "#SBATCH --exclude" not in (tmp_path / "out" / "train.sbatch").read_text()
    error = raised.value
    # the job's exit code is its steps' largest: the failing rank's 1, or 137 when --kill-on-bad-exit's
    # SIGKILL of the other node's step is recorded first
    assert (error.state, error.nodes) == ("FAILED", ["kiln-n1", "kiln-n2"]) and error.exit_code in ("1:0", "137:0")
    assert error.hosts == []  # which of two nodes failed is for the torchrun summary in the log to say
    assert (f"Slurm job {error.job_id} (kiln-train) on kiln-n1,kiln-n2 ended FAILED with exit code "
            f"{error.exit_code}") in str(error)
    log = error.log.read_text()
    assert error.log == launcher.log_path(error.job_id) and "exitcode  : 3" in log  # the job's log, kept in out_dir
    lines = sorted(line for line in log.splitlines() if line.startswith("rank "))
    # each rank on its own node (torchrun's rendezvous decides which rank lands where)
    assert sorted(line.split()[1] for line in lines) == ["0", "1"]
    assert sorted(line.split()[-1] for line in lines) == ["kiln-n1", "kiln-n2"]
    streamed = [r.getMessage() for r in caplog.records if r.name == "kiln.launch.slurm"]
    assert {f"[job {error.job_id}] {line}" for line in lines} <= set(streamed)
    assert any("not excluding the failed hosts kiln-n1" in m for m in streamed)


def test_sigterm_to_the_waiting_process_cancels_the_job(slurm_two_nodes, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    waiting = subprocess.Popen([sys.executable, "-c", WAIT_ON_A_JOB, str(tmp_path / "out"), str(free_port()),
                                str(sleeper)], cwd=REPO, env={**os.environ, **slurm_two_nodes.env})
    try:
        job_id = _running_job("kiln-cancel")
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=60) == -signal.SIGTERM  # cancelled, then ended by the signal as before
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert _squeue("--jobs", job_id) == ""  # already gone from the queue when the process ended
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "JobState=CANCELLED" in shown


def _squeue(*args: str) -> str:
    return subprocess.run(["squeue", "--noheader", "--format", "%i %T", *args], capture_output=True,
                          text=True).stdout.strip()


def _running_job(name: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued = _squeue("--name", name)
        if queued.endswith(" RUNNING"):
            return queued.split()[0]
        time.sleep(0.2)
    raise AssertionError(f"no running job {name!r} after {timeout_s:g} s (squeue: {queued!r})")
