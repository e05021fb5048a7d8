"""A real single-node Slurm cluster on this machine: munged, slurmctld and slurmd from Debian's packages.

The test suite, the scale-out benchmark and anyone trying the Slurm paths on a laptop start one
with `LocalSlurmCluster(folder).start()`; its clients (`sbatch`, `squeue`, `scontrol`, `scancel`)
find it through `SLURM_CONF` (see `env`). Everything it writes — config, state, spool, pid files,
daemon logs — stays in `folder`, and its ports are picked free, so several clusters (two test
sessions) can run side by side. There is no accounting daemon: jobs are followed with `squeue` and
`scontrol show job`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tasks.errors import KilnError

DAEMONS = ("slurmctld", "slurmd")
START_TIMEOUT_S = 30.0
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class SlurmUnavailable(KilnError):
    """Slurm or munge is not installed, or the daemons did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurmCluster:
    """One node (this host) with `cpus` CPUs in one default partition, `debug`."""

    partition = "debug"

    def __init__(self, folder: Path, cpus: int | None = None, memory_mb: int = 4000) -> None:
        self.folder = folder.resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> LocalSlurmCluster:
        missing = [tool for tool in ("munged", *DAEMONS, "sbatch") if shutil.which(tool) is None]
        if missing:
            raise SlurmUnavailable(f"{', '.join(missing)} not found: install Debian's slurm-wlm and munge "
                                   "(`bash infra/system-packages.sh`, which `make setup` runs)")
        self._start_munge()
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config(free_port(), free_port()))
        for daemon in DAEMONS:
            log = (self.folder / "log" / f"{daemon}.out").open("ab")
            subprocess.Popen([daemon, "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **self.env}, start_new_session=True)
        self._wait_until_idle()
        return self

    def stop(self) -> None:
        """Stop both daemons (by their pid files) and wait for them to exit; munged is shared, so it stays."""
        for daemon in reversed(DAEMONS):
            pid_file = self.folder / f"{daemon}.pid"
            if not pid_file.is_file():
                continue
            pid = int(pid_file.read_text().strip() or 0)
            if pid <= 0:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_munge(self) -> None:
        if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        if not MUNGE_KEY.is_file():
            subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
            shutil.chown(MUNGE_KEY, "munge", "munge") if _user_exists("munge") else None
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        if _user_exists("munge"):
            shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
        started = subprocess.run(["munged", "--force"], capture_output=True, text=True)
        if started.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {started.stderr.strip()}")

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        f = self.folder
        return "\n".join([
            "ClusterName=kiln-local",
            f"SlurmctldHost={self.node}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd.log'}",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={f / 'log' / 'jobcomp.txt'}",
            "KillWait=5",
            "MinJobAge=300",
            f"NodeName={self.node} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                  env={**os.environ, **self.env})
            state = done.stdout.strip() or done.stderr.strip()
            if done.returncode == 0 and state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.3)
        self.stop()
        logs = "\n".join(_tail(self.folder / "log" / f"{d}.log") for d in DAEMONS)
        raise SlurmUnavailable(f"the local Slurm cluster in {self.folder} did not become idle in "
                               f"{START_TIMEOUT_S:g} s (last sinfo: {state!r}); daemon logs:\n{logs}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else f"({path} missing)"
