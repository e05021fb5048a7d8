"""A real Slurm cluster on this machine: munged, slurmctld and slurmd from Debian's packages.

The test suite, the scale-out benchmark and anyone trying the Slurm paths on a laptop start one
with `LocalSlurmCluster(folder).start()` (from a shell: `kiln slurm up`); its clients (`sbatch`,
`squeue`, `scontrol`, `scancel`) find it through `SLURM_CONF` (see `env`). Everything it writes —
config, state, spool, pid files, daemon logs — stays in `folder`, and its ports are picked free, so
several clusters (two test sessions) can run side by side. There is no accounting daemon: jobs are followed with `squeue` and
`scontrol show job`.

`nodes=1` is this host under its own name. `nodes=2` or more runs one slurmd per node on this host
(`slurmd -N kiln-n1`, Debian's build supports several slurmd per host), each node with its own port
and spool and `NodeAddr=127.0.0.1`: a real multi-node cluster to the scheduler, so that a job spans
nodes, `--exclude` moves a job to another node, and `SLURMD_NODENAME` differs between them. Every
node claims `cpus` CPUs of the same machine (the scheduler does not bind them: `task/none`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kiln.tasks.errors import KilnError

DAEMONS = ("slurmctld", "slurmd")
START_TIMEOUT_S = 30.0
_CONF_FIELD = re.compile(r"(\w+)=(\S+)")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class SlurmUnavailable(KilnError):
    """Slurm or munge is not installed, or the daemons did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurmCluster:
    """`nodes` nodes with `cpus` CPUs each in one default partition, `debug`."""

    partition = "debug"

    def __init__(self, folder: Path, cpus: int | None = None, memory_mb: int = 4000, nodes: int = 1) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {nodes}")
        self.folder = folder.resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.node = socket.gethostname().split(".")[0]  # this host
        # the scheduler's node names: this host's own name, or one emulated node per slurmd
        self.node_names = [self.node] if nodes == 1 else [f"kiln-n{i}" for i in range(1, nodes + 1)]
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
        self.conf.write_text(self._config(free_port(), [free_port() for _ in self.node_names]))
        commands = {"slurmctld": ["slurmctld", "-f", str(self.conf)]}  # daemon log name -> argv
        if self.multiple:
            for name in self.node_names:
                (self.folder / "spool" / name).mkdir(exist_ok=True)
                commands[f"slurmd-{name}"] = ["slurmd", "-f", str(self.conf), "-N", name]
        else:
            commands["slurmd"] = ["slurmd", "-f", str(self.conf)]
        for log_name, argv in commands.items():
            log = (self.folder / "log" / f"{log_name}.out").open("ab")
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                             start_new_session=True)
        self._wait_until_idle()
        return self

    @classmethod
    def in_folder(cls, folder: Path) -> LocalSlurmCluster | None:
        """The cluster an earlier `start` (maybe another process's: `kiln slurm up`) configured in `folder`,
        its nodes and CPUs read back from its slurm.conf; None when there is none."""
        conf = folder / "slurm.conf"
        if not conf.is_file():
            return None
        nodes = [dict(_CONF_FIELD.findall(line)) for line in conf.read_text().splitlines()
                 if line.startswith("NodeName=")]
        if not nodes:
            return None
        cluster = cls(folder, cpus=int(nodes[0]["CPUs"]), memory_mb=int(nodes[0]["RealMemory"]), nodes=len(nodes))
        cluster.node_names = [node["NodeName"] for node in nodes]
        return cluster

    def running(self) -> bool:
        """Whether this cluster's controller is up (its pid file names a live slurmctld of this config)."""
        pid_file = self.folder / "slurmctld.pid"
        try:
            pid = int(pid_file.read_text().strip() or 0)
        except (OSError, ValueError):
            return False
        return pid > 0 and _alive(pid) and self._is_daemon(pid)

    @property
    def multiple(self) -> bool:
        """Several slurmd on this host (emulated nodes)."""
        return len(self.node_names) > 1

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop its daemons (by their pid files) and wait for them to
        exit; munged is shared, so it stays.

        A job's steps run under their own slurmstepd, which outlives slurmd: cancelled first, they
        end with the cluster instead of running on unowned. The daemons are signalled first and then
        awaited together: each takes ~2 s to shut down. A pid file whose process is not this
        cluster's daemon (it died and the pid was reused) is left alone."""
        self._cancel_jobs()
        slurmds = [f"slurmd-{name}" for name in self.node_names] if self.multiple else ["slurmd"]
        stopping = []
        for daemon in [*slurmds, "slurmctld"]:
            pid_file = self.folder / f"{daemon}.pid"
            if not pid_file.is_file():
                continue
            pid = int(pid_file.read_text().strip() or 0)
            if pid <= 0 or not self._is_daemon(pid):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            stopping.append(pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in stopping):
            time.sleep(0.1)
        for pid in stopping:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _cancel_jobs(self, timeout_s: float = 30.0) -> None:
        """scancel every job in this cluster's queue and wait until none is left (at most `timeout_s`)."""
        env = {**os.environ, **self.env}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                queued = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, env=env,
                                        timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return
            jobs = queued.stdout.split()
            if queued.returncode != 0 or not jobs:  # a controller that is not up has no jobs to cancel
                return
            subprocess.run(["scancel", *jobs], capture_output=True, env=env, timeout=timeout_s)
            time.sleep(0.5)

    def _is_daemon(self, pid: int) -> bool:
        """Whether `pid` runs with this cluster's config (`-f {conf}`)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return str(self.conf).encode() in argv

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

    def _config(self, ctld_port: int, slurmd_ports: list[int]) -> str:
        f = self.folder
        # %n: the node name, so that each emulated node's slurmd has its own spool, pid file and log
        per_node = "-%n" if self.multiple else ""
        if self.multiple:
            node_lines = [f"NodeName={name} NodeHostname={self.node} NodeAddr=127.0.0.1 Port={port} "
                          f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
                          for name, port in zip(self.node_names, slurmd_ports)]
        else:
            node_lines = [f"NodeName={self.node} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"]
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
            f"SlurmdPort={slurmd_ports[0]}",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}{'/%n' if self.multiple else ''}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / f'slurmd{per_node}.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / f'slurmd{per_node}.log'}",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={f / 'log' / 'jobcomp.txt'}",
            "KillWait=5",
            "MinJobAge=300",
            *node_lines,
            f"PartitionName={self.partition} Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                  env={**os.environ, **self.env})
            state = done.stdout.strip() or done.stderr.strip()
            states = state.split()
            if done.returncode == 0 and len(states) == len(self.node_names) and \
                    set(states) <= {"idle", "mixed", "allocated"}:
                return
            time.sleep(0.3)
        self.stop()
        logs = "\n".join(_tail(path) for path in sorted((self.folder / "log").glob("slurm*.log")))
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
