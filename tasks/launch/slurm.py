"""The Slurm launcher: sbatch a script that runs torchrun under srun on every node of the allocation,
and follow the job to its end like a local launch.

`launch`:

1. decides what to exclude (`plan_exclusion`): `cluster.exclude_hosts` plus the run's recorded
   failed hosts, limited to nodes the cluster knows (sbatch refuses the whole job over one unknown
   name). When excluding the recorded failures would leave the partition fewer usable nodes than
   the job needs, the job goes out without them (a warning, and `exclusion_dropped` for the
   caller's record): a job that can never start helps nobody, and a rank that died may have died
   of its own fault, not its node's. `cluster.exclude_hosts` is the user's word and always holds;
2. `sbatch --parsable` of the rendered `infra/slurm/train.sbatch.j2`;
3. polls `scontrol show job` (no `sacct`: it needs an accounting daemon) and streams the job's
   output file, which stays in `out_dir`, into the `kiln.launch.slurm` logger as it grows;
4. returns when the job is COMPLETED; any other end (FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...)
   raises `SlurmJobFailed`, a `LaunchError` carrying the job's id, state, exit code and nodes, with
   the output file as its log, so relaunch loops resubmit. CANCELLED by someone else's `scancel`
   raises `SlurmJobCancelled`, which is not retryable: a person stopped it, no node failed. A
   submission sbatch refuses (a bad partition, no `SLURM_CONF`) is not retryable either;
5. Ctrl-C, SIGTERM or any error while waiting `scancel`s the job, waits until it has left the
   queue, and re-raises (`sigterm_raises`: main thread only).

Without `sbatch` on PATH the script is written and the message says how to submit it.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from kiln.tasks.launch.cluster import container_flags
from kiln.tasks.launch.slurm_jobs import check_slurm_conf, submit
from kiln.tasks.launch.launchers import (
    INFRA_DIR,
    LOG_TAIL_CHARS,
    Launcher,
    LaunchError,
    LaunchResult,
    render_template,
    sigterm_raises,
)

logger = logging.getLogger("kiln.launch.slurm")

POLL_S = 2.0  # longest pause between `scontrol show job` calls (the first ones come faster)
FIRST_POLL_S = 0.25
CLIENT_TIMEOUT_S = 60.0  # one scontrol/squeue/sinfo/scancel call
MAX_POLL_ERRORS = 5  # consecutive failed polls (controller unreachable) before the launch gives up
CANCEL_WAIT_S = 60.0  # after scancel, how long to wait for the job to leave the queue
WAITING_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                  "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# node states (sinfo %T, flags and "+..." removed) in which a node can run a job now or soon
USABLE_NODE_STATES = {"idle", "mixed", "allocated", "completing", "planned", "reserved", "powered_down",
                      "powering_up"}
_FIELD = re.compile(r"(\w+)=(\S*)")


class SlurmJobFailed(LaunchError):
    """The job ended other than COMPLETED; `state`, `exit_code` ("exit:signal") and `nodes` as Slurm saw them."""

    def __init__(self, message: str, log: Path, *, job_id: str, state: str, exit_code: str, nodes: list[str]) -> None:
        # a job on one node names its host; a multi-node job's failed ranks are found in its log
        super().__init__(message, log=log, hosts=nodes if len(nodes) == 1 else (), job_id=job_id)
        self.state = state
        self.exit_code = exit_code
        self.nodes = nodes


class SlurmJobCancelled(SlurmJobFailed):
    """Someone scancelled the job (not Kiln's own `stop` or `cancel`): a person's decision, not a node's
    failure, so it is not retryable and names no failed host."""

    retryable = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hosts = []


@dataclass(frozen=True)
class Exclusion:
    """What a submission excludes, and what it could not."""

    hosts: tuple[str, ...]  # passed to --exclude
    dropped: tuple[str, ...] = ()  # recorded failed hosts used again: excluding them left too few nodes
    unknown: tuple[str, ...] = ()  # names the cluster has no node for (say, a hostname that is no node name)


def plan_exclusion(nodes_needed: int, configured: Collection[str], failed: Collection[str],
                   partition_nodes: Mapping[str, str] | None, known_nodes: Collection[str] | None) -> Exclusion:
    """The exclusion policy (module docstring, step 1) as a pure function.

    `partition_nodes`: the job's partition's nodes and their sinfo states; `known_nodes`: every node
    of the cluster. Either None (sinfo could not say) leaves the wanted exclusion as it is.
    """
    wanted = set(configured) | set(failed)
    unknown = set()
    if known_nodes is not None:
        unknown = wanted - set(known_nodes)
        wanted -= unknown
    if partition_nodes is None:
        return Exclusion(tuple(sorted(wanted)), unknown=tuple(sorted(unknown)))
    usable = {node for node, state in partition_nodes.items() if _usable(state)}
    if len(usable - wanted) >= nodes_needed:
        return Exclusion(tuple(sorted(wanted)), unknown=tuple(sorted(unknown)))
    kept = wanted & set(configured)
    return Exclusion(tuple(sorted(kept)), dropped=tuple(sorted(wanted - kept)), unknown=tuple(sorted(unknown)))


def _usable(state: str) -> bool:
    return state.split("+")[0].rstrip("*~#!%$@^-") in USABLE_NODE_STATES


class SlurmLauncher(Launcher):
    """An sbatch script from `infra/slurm/train.sbatch.j2`: one srun task per node, each a torchrun
    (`python -m torch.distributed.run` of `python`, by default this interpreter, so that a node
    runs the same environment without `torchrun` on its PATH) whose c10d rendezvous runs on the
    allocation's first node. On a CPU-only cluster each task gets `nproc_per_node` CPUs.
    `torchrun=False` runs `python` itself instead, for a one-process job (a sweep's trials)."""

    name = "slurm"
    template = "slurm/train.sbatch.j2"
    filename = "train.sbatch"

    def __init__(self, *args, template_dir: Path = INFRA_DIR, poll_s: float = POLL_S, python: str = sys.executable,
                 torchrun: bool = True, on_submit: Callable[[str], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_submit = on_submit  # told the job's id as soon as sbatch gives it (the stage's lock records it)
        self.template_dir = template_dir
        self.poll_s = poll_s
        self.python = python
        self.torchrun = torchrun
        if not torchrun and (self.cluster.nodes > 1 or self.nproc_per_node > 1):
            raise ValueError("SlurmLauncher(torchrun=False) runs one process: give it one node and nproc_per_node=1")

    def render(self, command: list[str], exclude: Collection[str] | None = None) -> str:
        """The script; `exclude` defaults to every wanted exclusion (`launch` passes `plan_exclusion`'s)."""
        c = self.cluster
        return render_template(self.template_dir, self.template,
            job_name=self.job_name, nodes=c.nodes, gpus_per_node=c.gpus_per_node, nproc_per_node=self.nproc_per_node,
            partition=c.partition, time_limit=c.time_limit,
            exclude=sorted(self.exclude_hosts() if exclude is None else exclude), log_dir=str(self.out_dir),
            workdir=str(self.workdir), env={**c.slurm.env, **self.env}, rdzv_port=c.rdzv_port,
            python="python" if c.image else self.python, command=command,
            torchrun=self.torchrun, slurm=c.slurm, container=self._container_flags(),
            cpus_per_task=c.slurm.cpus_per_task or (self.nproc_per_node if c.gpus_per_node == 0 else None),
        )

    def _container_flags(self) -> str:
        """pyxis's srun options for `cluster.image` (the image's `python` then runs Kiln)."""
        flags = container_flags(self.cluster.image, self.cluster.slurm.container_mounts, self.workdir)
        return " " + shlex.join(f"--{name}={value}" for name, value in flags.items()) if flags else ""

    def log_path(self, job_id: str) -> Path:
        """The job's output file (the script's `--output`)."""
        return self.out_dir / f"{self.job_name}-{job_id}.out"

    def launch(self, command: list[str]) -> LaunchResult:
        """Submit and wait (see the module docstring); raises SlurmJobFailed when the job fails."""
        sbatch = self._client("sbatch")
        if sbatch is not None:
            check_slurm_conf()
        exclusion = self.plan_exclusion() if sbatch is not None else Exclusion(tuple(self.exclude_hosts()))
        path = self._write(self.filename, self.render(command, exclude=exclusion.hosts))
        if sbatch is None:
            return LaunchResult(self.name, submitted=False, rendered=path,
                                message=f"sbatch is not on PATH: wrote {path}; submit it with `sbatch {path}`")
        job_id = self.job_id = submit(path, sbatch=sbatch)  # a refusal raises SubmissionRefused: never resubmitted
        if self.on_submit is not None:
            self.on_submit(job_id)
        logger.info("submitted Slurm job %s (%s) from %s%s", job_id, self.job_name, path,
                    f", excluding {','.join(exclusion.hosts)}" if exclusion.hosts else "")
        log = self.log_path(job_id)
        if self._stopped.is_set():  # stopped while it was being submitted
            self.cancel(job_id)
        with sigterm_raises(f"Slurm job {job_id}"):
            try:
                job = self._wait(job_id, log)
            except BaseException:  # Ctrl-C, SIGTERM (Terminated), the timeout, a failed poll: the job
                self.cancel(job_id)  # must not outlive the process that waits for it
                raise
        state, exit_code = job.get("JobState", "?"), job.get("ExitCode", "?")
        nodes = self._hostnames(job.get("NodeList", ""))
        where = f"Slurm job {job_id} ({self.job_name}) on {','.join(nodes) or 'no node'}"
        if state == "COMPLETED":
            return LaunchResult(self.name, submitted=True, returncode=0, job_id=job_id, rendered=path, log=log,
                                message=f"{where} completed; log: {log}")
        tail = log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:] if log.is_file() else "(no output)"
        if state == "CANCELLED" and not self._stopped.is_set():
            raise SlurmJobCancelled(
                f"{where} was cancelled (scancel) while Kiln waited for it: a cancelled job is not relaunched and "
                f"its nodes are not counted as failed; rerun to resume from its last checkpoint. log: {log}\n{tail}",
                log, job_id=job_id, state=state, exit_code=exit_code, nodes=nodes)
        reason = job.get("Reason", "None")
        raise SlurmJobFailed(
            f"{where} ended {state} with exit code {exit_code}{f' ({reason})' if reason != 'None' else ''}; "
            f"log: {log}\n{tail}", log, job_id=job_id, state=state, exit_code=exit_code, nodes=nodes)

    def plan_exclusion(self) -> Exclusion:
        """`plan_exclusion` for this cluster, from `sinfo`; sets `excluded` and `exclusion_dropped`."""
        failed = set(self.exclude_hosts()) - set(self.cluster.exclude_hosts)
        partition_nodes, known = self._node_states()
        exclusion = plan_exclusion(self.cluster.nodes, self.cluster.exclude_hosts, failed, partition_nodes, known)
        if exclusion.unknown:
            logger.warning("not excluding %s: the Slurm cluster has no node of that name", ", ".join(exclusion.unknown))
        if exclusion.dropped:
            logger.warning("not excluding the failed hosts %s: without them the partition has fewer than the %d "
                           "usable nodes the job needs, so it is resubmitted onto them",
                           ", ".join(exclusion.dropped), self.cluster.nodes)
        self.excluded, self.exclusion_dropped = list(exclusion.hosts), list(exclusion.dropped)
        return exclusion

    def stop(self) -> None:
        """scancel the job this launcher waits on (from another thread): its wait then raises SlurmJobFailed."""
        super().stop()
        if self.job_id is not None:
            self.cancel(self.job_id)

    def cancel(self, job_id: str) -> None:
        """scancel the job and wait (up to CANCEL_WAIT_S) until it has left the queue."""
        scancel = self._client("scancel") or "scancel"
        done = self._run(scancel, job_id)
        if done.returncode != 0:
            logger.error("scancel %s failed (exit %d): %s", job_id, done.returncode, done.stderr.strip())
            return
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            queued = self._run(self._client("squeue") or "squeue", "--noheader", "--jobs", job_id, "--format", "%T")
            if queued.returncode != 0 or not queued.stdout.strip():  # gone (or already forgotten)
                logger.warning("cancelled Slurm job %s", job_id)
                return
            time.sleep(0.25)
        logger.error("Slurm job %s is still queued %g s after scancel", job_id, CANCEL_WAIT_S)

    def _wait(self, job_id: str, log: Path) -> dict[str, str]:
        """Poll until the job leaves the waiting states, streaming its log; its last `scontrol` fields."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        stream = _LogStream(log, job_id)
        pause, errors = FIRST_POLL_S, 0
        scontrol = self._client("scontrol") or "scontrol"
        while True:
            shown = self._run(scontrol, "show", "job", "--oneliner", job_id)
            if shown.returncode == 0:
                errors = 0
                job = dict(_FIELD.findall(shown.stdout))
                state = job.get("JobState", "")
                if state and state not in WAITING_STATES:
                    stream.read(final=True)
                    return job
            else:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    raise LaunchError(f"`scontrol show job {job_id}` failed {errors} times in a row "
                                      f"(exit {shown.returncode}): {shown.stderr.strip()}", log=log, job_id=job_id)
            stream.read()
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"Slurm job {job_id} ({self.job_name}) ran past its {self.timeout_s:g} s timeout "
                                  f"and is cancelled; log: {log}", log=log, job_id=job_id)
            time.sleep(pause)
            pause = min(pause * 2, self.poll_s)

    def _node_states(self) -> tuple[dict[str, str] | None, set[str] | None]:
        """(the job's partition's nodes -> state, every node name); (None, None) when sinfo cannot say."""
        sinfo = self._client("sinfo")
        if sinfo is None:
            return None, None
        done = self._run(sinfo, "--noheader", "--Node", "--format", "%N|%P|%T")
        if done.returncode != 0:
            logger.warning("sinfo failed (exit %d): %s; excluding without checking the partition",
                           done.returncode, done.stderr.strip())
            return None, None
        partition, known = {}, set()
        for line in done.stdout.splitlines():
            node, name, state = (line.split("|") + ["", ""])[:3]
            known.add(node)
            # the default partition is the one sinfo marks with '*'
            if name.rstrip("*") == self.cluster.partition or (self.cluster.partition is None and name.endswith("*")):
                partition[node] = state
        return partition, known

    def _hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist == "(null)":
            return []
        done = self._run(self._client("scontrol") or "scontrol", "show", "hostnames", nodelist)
        return done.stdout.split() if done.returncode == 0 else [nodelist]

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(list(argv), 124, "", f"no answer in {CLIENT_TIMEOUT_S:g} s")


class _LogStream:
    """Forwards the lines a job appends to its output file to the `kiln.launch.slurm` logger."""

    def __init__(self, path: Path, job_id: str) -> None:
        self.path, self.job_id = path, job_id
        self.offset, self.partial = 0, b""

    def read(self, final: bool = False) -> None:
        """Log the complete lines added since the last call; `final`: the unterminated rest too."""
        if not self.path.is_file():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            logger.info("[job %s] %s", self.job_id, line.decode("utf-8", errors="replace"))
