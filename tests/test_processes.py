"""The kill helpers of `tests/processes.py` kill only the test's own processes, beside look-alikes.

Each kill runs while a process with the same title, which the test did not start through the engine
it kills in, appears inside the kill window (the one-time bug: a Ray test SIGKILLed another run's
`ray::RankWorker`, the first new process with that title on the machine): a RankWorker actor of a
second local Ray cluster that has forked a child as datatrove's rank workers do, a job step of a
second local Slurm cluster running the same command line, a process titled like `kiln worker`.
The look-alike must be alive and unchanged afterwards, and the test's own process dead.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from kiln.tasks.launch.local_slurm import LocalSlurmCluster
from tests.processes import kill_tree, killing_first, ray_actors, slurm_job_steps, tree


def fork_a_child() -> tuple[int, int]:
    """Fork a child that lives until its parent dies (so that nothing outlives the test), as a rank
    worker forks its rank; returns both pids."""
    import os
    import time

    parent = os.getpid()
    child = os.fork()
    if child == 0:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)
    return parent, child


FORK = inspect.getsource(fork_a_child)

# A second local Ray cluster, in a process of its own: on each line the test sends, it creates its
# RankWorker actor (which forks) and prints its pids, then prints its actor's pid as the actor
# answers it, then shuts down. Its answers start with "answer:" (Ray may print to stdout too).
OTHER_RAY_CLUSTER = FORK + """
import sys
import ray

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote
class RankWorker:
    def fork(self):
        return fork_a_child()

    def pid(self):
        import os
        return os.getpid()

sys.stdin.readline()
worker = RankWorker.remote()
print("answer:", *ray.get(worker.fork.remote()), flush=True)
sys.stdin.readline()
print("answer:", ray.get(worker.pid.remote()), flush=True)
sys.stdin.readline()
"""


class RankWorker:
    """This test's own actor, with the title of datatrove's (`ray::RankWorker`)."""

    def run_a_rank(self) -> None:
        """Fork, then wait on the child, as datatrove's actor waits on its ranks."""
        fork_a_child()
        time.sleep(600)

    def pid(self) -> int:
        return os.getpid()


def snapshot(pids: list[int]) -> list[tuple[int, float, list[str], str]]:
    """What must not change about a look-alike: its pid, start time, command line and that it runs."""
    return [(p.pid, p.create_time(), p.cmdline(), "alive" if p.status() != psutil.STATUS_ZOMBIE else "zombie")
            for p in map(psutil.Process, pids)]


def wait_for(done: Callable[[], object], what: str, timeout_s: float = 120) -> object:
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        assert time.monotonic() < deadline, f"still waiting after {timeout_s:g} s for {what}"
        time.sleep(0.1)
    return result


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ask(other: subprocess.Popen) -> list[int]:
    """Send the other Ray cluster's process a line, read the pids it answers."""
    other.stdin.write("\n")
    other.stdin.flush()
    for line in other.stdout:
        if line.startswith("answer:"):
            return [int(pid) for pid in line.split()[1:]]
    raise AssertionError(f"the other Ray cluster's process (pid {other.pid}) ended: exit {other.wait()}")


def test_a_ray_rank_worker_is_killed_and_another_clusters_is_not(ray_cluster):
    ray = ray_cluster
    other = subprocess.Popen([sys.executable, "-c", OTHER_RAY_CLUSTER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ours = ray.remote(RankWorker).remote()
        with killing_first(ray_actors("RankWorker", forked=True)) as killed:
            theirs = ask(other)  # its actor has forked: a new `ray::RankWorker` with a child
            before = snapshot(theirs)
            pid = ray.get(ours.pid.remote())
            running = ours.run_a_rank.remote()
            wait_for(lambda: killed, f"the watcher to kill this test's RankWorker actor (pid {pid})")
        assert killed == [pid]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(running)
        assert gone(pid)
        assert snapshot(theirs) == before
        assert ask(other) == theirs[:1]  # its actor still answers
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            kill_tree(other.pid)
            other.wait()


def sbatch(env: dict[str, str], folder: Path, program: Path) -> str:
    script = folder / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH --output={folder}/out-%j.txt\n"
                      f"srun {sys.executable} {program}\n")
    return subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()


def job_state(env: dict[str, str], job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           env={**os.environ, **env}).stdout
    return next((w.split("=")[1] for w in shown.split() if w.startswith("JobState=")), "")


def test_a_slurm_job_step_is_killed_and_another_clusters_is_not(slurm_cluster, tmp_path):
    program = tmp_path / "rank.py"  # one command line for both clusters' jobs
    program.write_text("import time\ntime.sleep(600)\n")
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    other = LocalSlurmCluster(theirs_dir, cpus=1).start()
    try:
        with killing_first(slurm_job_steps(slurm_cluster.env, argument=str(program))) as killed:
            their_job = sbatch(other.env, theirs_dir, program)
            theirs = wait_for(slurm_job_steps(other.env, argument=str(program)),
                              f"job {their_job} of the other Slurm cluster ({other.conf}) to start its step")
            before = snapshot(theirs)
            our_job = sbatch(slurm_cluster.env, ours_dir, program)
            wait_for(lambda: killed, f"the watcher to kill the step of job {our_job} ({slurm_cluster.conf})")
        wait_for(lambda: job_state(slurm_cluster.env, our_job) not in ("PENDING", "RUNNING", "COMPLETING"),
                 f"job {our_job} on {slurm_cluster.conf} to end")
        assert job_state(slurm_cluster.env, our_job) == "FAILED"
        assert gone(killed[0])
        assert snapshot(theirs) == before
        assert job_state(other.env, their_job) == "RUNNING"
    finally:
        other.stop()  # cancels its job first


def test_a_worker_tree_is_killed_and_a_process_titled_like_it_is_not():
    """`kiln worker` and the flow run it started, killed as tests/flows/test_operate.py kills its own."""
    title = [sys.executable, "-c", FORK + "fork_a_child()\nimport time\ntime.sleep(600)\n", "-m", "kiln.flows.cli", "worker"]
    ours = subprocess.Popen(title, start_new_session=True)
    other = subprocess.Popen(title, start_new_session=True)
    try:
        ours_tree = [p.pid for p in wait_for(lambda: tree(ours.pid)[1:] and tree(ours.pid), "this test's worker to fork")]
        theirs = [p.pid for p in wait_for(lambda: tree(other.pid)[1:] and tree(other.pid), "the other worker to fork")]
        before = snapshot(theirs)
        kill_tree(ours.pid)
        assert ours.wait(timeout=30) == -signal.SIGKILL
        assert all(gone(pid) for pid in ours_tree)
        assert snapshot(theirs) == before
    finally:
        kill_tree(other.pid)
        other.wait()
