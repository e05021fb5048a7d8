"""The processes a test owns, and how a test kills one of them.

Tests share the machine with other test sessions and other Kiln runs, whose Ray workers, Slurm job
steps and `kiln worker`s carry the same titles as a test's own. So a test never picks a process by
its title across the machine: it starts from what it owns, a process it spawned (and the tree below
it), the live actors of its own Ray job (their pids from its cluster's actor table), or the job steps
of the Slurm cluster it started (their pids from that cluster's slurmd), and looks at titles only
among those. `tests/test_processes.py` runs each path beside look-alikes of another cluster.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import psutil

Candidates = Callable[[], Iterable[int]]


def tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process below it, parents first (none once it has exited)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, as when its machine dies. psutil checks, before
    each signal, that the pid still names the process it listed (not a new one that reused it)."""
    for process in reversed(tree(pid)):  # the leaves first: a parent cannot replace a killed child
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def argv(pid: int) -> tuple[str, ...]:
    """The process's command line (empty once it has exited)."""
    try:
        return tuple(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ()


def has_children(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return False


def _identity(pid: int) -> tuple[int, float] | None:
    """A pid with its start time: a process, not a number the kernel may hand out again."""
    try:
        return pid, psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


@contextmanager
def killing_first(candidates: Candidates, poll_s: float = 0.01) -> Iterator[list[int]]:
    """While the block runs, a watcher thread SIGKILLs (with its tree) the first process that
    `candidates()` names and did not name on entry: processes of an earlier run on their way out
    are left alone. The list it yields then holds the pid killed. `candidates` must name only the
    test's own processes (see `ray_actors`, `slurm_job_steps`); an error it raises is raised here
    when the block ends, not lost with the thread."""
    seen = {_identity(pid) for pid in candidates()}
    killed: list[int] = []
    failed: list[Exception] = []
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                for pid in candidates():
                    identity = _identity(pid)
                    if identity is not None and identity not in seen:
                        kill_tree(pid)
                        killed.append(pid)
                        return
                time.sleep(poll_s)
        except Exception as error:  # handed to the test's thread below
            failed.append(error)

    watcher = threading.Thread(target=watch, name="killing_first", daemon=True)
    watcher.start()
    try:
        yield killed
    except BaseException as error:
        stop.set()
        watcher.join()
        if failed:  # most likely why the block failed: it waited for a kill that could not come
            error.add_note(f"killing_first's watcher had failed: {failed[0]!r}")
        raise
    stop.set()
    watcher.join()
    if failed:
        raise failed[0]


def ray_actors(class_name: str, *, forked: bool = False) -> Candidates:
    """The pids of the live `class_name` actors of this process's Ray job, as its cluster's actor
    table records them (actors of another job or another cluster are never named); with `forked`,
    only those that have started a child process.

    `ray.util.state` would need the Ray dashboard, which the test cluster does not run; the actor
    table is `ray._private.state`, a private module: `tests/test_processes.py` fails on the Ray
    upgrade that moves it."""
    import ray
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())

    def pids() -> list[int]:
        actors = state.actors(job_id=job, actor_state_name="ALIVE").values()
        found = [a["Pid"] for a in actors if a["ActorClassName"] == class_name and a["Pid"]]
        return [pid for pid in found if has_children(pid)] if forked else found

    return pids


def _slurm_conf(pid: int) -> str | None:
    """The SLURM_CONF in the process's environment (None without one, or once it has exited)."""
    try:
        return psutil.Process(pid).environ().get("SLURM_CONF")
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def slurm_job_steps(env: Mapping[str, str], *, argument: str) -> Candidates:
    """The pids of the Python processes running in job steps of the one-node Slurm cluster that
    `env` (its SLURM_CONF) reaches, as its slurmd lists them (`scontrol listpids`), with `argument`
    among their arguments: a job's own program, not the slurmstepd, shell or srun around it.
    `scontrol listpids` once named another cluster's step on the same node (CI, December 2026:
    proctrack/linuxproc walks /proc), so a process whose environment names another SLURM_CONF
    is left out."""
    def pids() -> list[int]:
        listed = subprocess.run(["scontrol", "listpids"], capture_output=True, text=True, timeout=30,
                                env={**os.environ, **env})
        if listed.returncode != 0:
            if "no job steps" in listed.stderr.lower():
                return []
            raise RuntimeError(f"scontrol listpids on the Slurm cluster {env.get('SLURM_CONF')} failed "
                               f"(exit {listed.returncode}): {listed.stderr.strip()}")
        # PID JOBID STEPID LOCALID GLOBALID; a step that is starting may be listed with pid -1
        steps = [int(line.split()[0]) for line in listed.stdout.splitlines()[1:] if line.split()]
        return [pid for pid in steps if pid > 0
                if argument in (command := argv(pid)) and "python" in os.path.basename(command[0])
                and _slurm_conf(pid) in (None, env.get("SLURM_CONF"))]

    return pids
