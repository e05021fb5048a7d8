"""One seam for launching training: a local process, torchrun, Slurm or Kubernetes behind `Launcher`.

Every launcher takes the same `command` — a Python program's argv without the interpreter (a
script path or `-m module`, then its arguments) — and the same `ClusterSpec`. `render` shows what
would run (a command line, an sbatch script, a Job manifest); `launch` runs or submits it. Local
launches own their subprocess: they wait with a timeout and kill the whole process group on
expiry, because an orchestrator's own timeout does not reach a child process. Cluster launchers
submit only when their client (`sbatch`, `kubectl`) is on PATH; otherwise they write the rendered
file and say how to submit it.

Hosts that failed a previous attempt are recorded next to the run (`record_failed_hosts`) and
excluded, together with `cluster.exclude_hosts`, from every later render.

A launcher that waits on a cluster job cancels it when the wait is interrupted: Ctrl-C
(KeyboardInterrupt) or SIGTERM (Prefect's cancellation, `kill`), which `sigterm_raises` turns into
an exception in the main thread for the length of the wait. A launch waiting in another thread
(the sweep waits on several jobs at once) is ended from the main thread with `stop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jinja2

from kiln.tasks.bundled import shipped
from kiln.tasks.errors import ConfigError, InfrastructureError, KilnError
from kiln.tasks.launch.cluster import DEFAULT_RDZV_PORT, ClusterSpec

INFRA_DIR = shipped("infra")
KILL_GRACE_S = 10.0  # after SIGTERM, how long a timed-out job gets to exit before SIGKILL
LOG_TAIL_CHARS = 2000


class LaunchError(InfrastructureError):
    """A launched job failed, timed out, or could not be submitted. Retryable: the job resumes from its last
    checkpoint (a refusal that a retry cannot cure sets `retryable = False`).

    `log` is the job's whole output when it ran here (the message holds only its tail); `hosts` the
    hosts the launcher itself blames, when it can name them (this machine for a local launch);
    `job_id` the scheduler's id of the job.
    """

    def __init__(self, message: str, log: Path | None = None, *, hosts: Sequence[str] = (),
                 job_id: str | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.hosts = list(hosts)
        self.job_id = job_id


class LaunchCancelled(KilnError):
    """SIGTERM arrived while waiting, the job was cancelled, and the previous handler let the process go on.

    Not a LaunchError: a cancelled run must not be relaunched."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by `sigterm_raises` so that a wait unwinds and cancels its job."""


@dataclass(frozen=True)
class LaunchResult:
    launcher: str
    submitted: bool  # False when the client was missing and only the file was written
    returncode: int | None = None  # set when the launcher waited for the job
    job_id: str | None = None
    rendered: Path | None = None
    log: Path | None = None
    message: str = ""


def read_failed_hosts(path: Path) -> list[str]:
    """Hosts recorded as failed for this run (an absent file means none)."""
    if not path.is_file():
        return []
    return sorted(json.loads(path.read_text(encoding="utf-8")))


def record_failed_hosts(path: Path, hosts: Iterable[str]) -> list[str]:
    """Add `hosts` to the run's failed-host list (written atomically); returns the whole list."""
    merged = sorted(set(read_failed_hosts(path)) | {h for h in hosts if h})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return merged


class Launcher(ABC):
    """Runs `command` on `cluster`; rendered files and logs go to `out_dir`."""

    name: ClassVar[str]

    def __init__(
        self,
        cluster: ClusterSpec,
        out_dir: Path,
        job_name: str = "kiln-train",
        nproc_per_node: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        failed_hosts_file: Path | None = None,
        workdir: Path | None = None,
        search_path: str | None = None,
    ) -> None:
        """`nproc_per_node` defaults to the cluster's GPUs per node (1 on a CPU-only cluster);
        `search_path` is where clients are looked up (default: $PATH)."""
        self.cluster = cluster
        self.out_dir = out_dir
        self.job_name = job_name
        self.nproc_per_node = nproc_per_node or max(cluster.gpus_per_node, 1)
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self.failed_hosts_file = failed_hosts_file
        self.workdir = workdir or Path.cwd()
        self.search_path = search_path
        # what the last launch excluded, and the recorded failed hosts it used again because excluding
        # them would have left too few nodes (set by launchers that decide it at submission: Slurm)
        self.excluded: list[str] = []
        self.exclusion_dropped: list[str] = []
        self.job_id: str | None = None  # the scheduler's id of the job launched last (cluster launchers)
        self._proc: subprocess.Popen | None = None  # the process a local launch waits on
        self._stopped = threading.Event()

    def stop(self) -> None:
        """End what this launcher runs now, from another thread: its `launch` then raises. A launch
        that starts after this call is ended as soon as it has something to end."""
        self._stopped.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the waiting thread reaps it and raises

    def exclude_hosts(self) -> list[str]:
        recorded = read_failed_hosts(self.failed_hosts_file) if self.failed_hosts_file else []
        return sorted(set(self.cluster.exclude_hosts) | set(recorded))

    @abstractmethod
    def render(self, command: list[str]) -> str:
        """What `launch` would run or submit, as text."""

    @abstractmethod
    def launch(self, command: list[str]) -> LaunchResult:
        """Run (local launchers: to completion, raising LaunchError on failure) or submit."""

    def _client(self, tool: str) -> str | None:
        return shutil.which(tool, path=self.search_path)

    def _run_owned(self, argv: list[str]) -> LaunchResult:
        """Run `argv` in its own process group, log to out_dir, kill the group on timeout."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log = self.out_dir / f"{self.job_name}.log"
        with log.open("w", encoding="utf-8") as sink:
            proc = subprocess.Popen(argv, cwd=self.workdir, env={**os.environ, **self.env}, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self._proc = proc
            if self._stopped.is_set():
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                returncode = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise LaunchError(
                    f"{self.name} job {self.job_name!r} ran past its {self.timeout_s:g} s timeout and was "
                    f"killed; log: {log}\n{_tail(log)}", log=log, hosts=[socket.gethostname()]
                ) from None
            finally:
                self._proc = None
        if returncode != 0:
            raise LaunchError(
                f"{self.name} job {self.job_name!r} failed with exit code {returncode}; log: {log}\n{_tail(log)}",
                log=log, hosts=[socket.gethostname()],
            )
        return LaunchResult(self.name, submitted=True, returncode=0, log=log, message=f"finished; log: {log}")

    def _write(self, filename: str, text: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / filename
        path.write_text(text, encoding="utf-8")
        return path


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group (torchrun forwards it to its workers), then SIGKILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: Path) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]


@contextlib.contextmanager
def sigterm_raises(what: str) -> Iterator[None]:
    """While waiting on `what` (a cluster job), SIGTERM raises `Terminated`, so that the caller's
    `except` cancels the job; then the signal goes to the handler that was there before: the
    default one ends the process as SIGTERM would have, a Python one (Prefect's) runs, and if the
    process goes on, `LaunchCancelled` is raised.

    Only in the main thread (the only one Python runs handlers in) and only when SIGTERM was not ignored."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cancellation short
        raise Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)
        else:
            signal.raise_signal(signal.SIGTERM)  # SIG_DFL: the process ends here
        raise LaunchCancelled(f"SIGTERM while waiting for {what}: it was cancelled") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


class LocalLauncher(Launcher):
    """One process on this machine, with this interpreter."""

    name = "local"

    def render(self, command: list[str]) -> str:
        return shlex.join([sys.executable, *command])

    def launch(self, command: list[str]) -> LaunchResult:
        return self._run_owned([sys.executable, *command])


class TorchrunLauncher(Launcher):
    """`nproc_per_node` worker processes on this machine under torchrun (elastic c10d rendezvous).

    A single node uses `--standalone` (a private rendezvous on a free port); several nodes meet at
    `rdzv_host:cluster.rdzv_port`, and this command must then be started on each of them.
    """

    name = "torchrun"

    def __init__(self, *args, rdzv_host: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rdzv_host = rdzv_host

    def argv(self, command: list[str]) -> list[str]:
        if self.cluster.nodes == 1:
            rdzv = ["--standalone"]
        elif self.rdzv_host is None:
            raise ConfigError(
                f"cluster.nodes={self.cluster.nodes}: a multi-node torchrun needs rdzv_host (the first "
                "node's address); or use the slurm or kubernetes launcher, which find it themselves"
            )
        else:
            port = self.cluster.rdzv_port or DEFAULT_RDZV_PORT
            rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{self.rdzv_host}:{port}",
                    "--rdzv_id", self.job_name]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.cluster.nodes),
                "--nproc_per_node", str(self.nproc_per_node), *rdzv, *command]

    def render(self, command: list[str]) -> str:
        return shlex.join(self.argv(command))

    def launch(self, command: list[str]) -> LaunchResult:
        return self._run_owned(self.argv(command))


def render_template(template_dir: Path, name: str, **variables: object) -> str:
    """Render an infra template; a missing variable is an error, not an empty string."""
    return _templates(template_dir).get_template(name).render(**variables)


def _templates(template_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,  # a missing variable is a bug, not an empty string
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["shquote"] = shlex.quote
    env.filters["shjoin"] = shlex.join
    env.filters["tojson"] = json.dumps
    return env
