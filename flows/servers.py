"""`kiln up` / `kiln down`: a local Prefect server and MLflow tracking server for one working directory.

Both bind to 127.0.0.1 and keep their state under `{work_dir}/servers/` (SQLite databases, logs,
pid files), unless a database URL (Postgres) is given. `up` returns once both answer their
health checks and writes `servers/env`, the variables through which every later `kiln` command,
worker and deployment finds them (`PREFECT_API_URL`, `MLFLOW_TRACKING_URI`) and keeps its Prefect
client state in the working directory (`PREFECT_HOME={work_dir}/prefect`, not ~/.prefect).
Without those variables Kiln falls back to its embedded defaults.

`up` also records the working directory in the user's list of running servers
(`$XDG_STATE_HOME/kiln/servers.json`), so that `down` finds the last `up` from any folder and can
say which working directories have servers.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.errors import KilnError
from tasks.keylock import pid_alive

HOST = "127.0.0.1"
STATE_FILE = "servers.json"
ENV_FILE = "env"


@dataclass(frozen=True)
class Server:
    name: str
    pid: int
    url: str  # what clients set (PREFECT_API_URL, MLFLOW_TRACKING_URI)
    ui: str
    health: str
    log: str


def servers_dir(work_dir: str | Path) -> Path:
    return Path(work_dir).resolve() / "servers"


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((HOST, port)) != 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _python_tool(module: str) -> list[str]:
    """The server CLIs of the interpreter running Kiln (its venv), whatever is first on PATH."""
    return [sys.executable, "-m", module]


def _spawn(name: str, command: list[str], env: dict[str, str], folder: Path) -> tuple[int, Path]:
    log = folder / f"{name}.log"
    with open(log, "ab") as out:
        # its own process group: `down` stops the server and every worker process it forked
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return process.pid, log


def start_servers(work_dir: str | Path, *, prefect_port: int = 4200, mlflow_port: int = 5000,
                  prefect_database: str | None = None, mlflow_database: str | None = None,
                  timeout_s: float = 120.0) -> list[Server]:
    """Start both servers (or report the running ones) and wait until they are healthy."""
    folder = servers_dir(work_dir)
    folder.mkdir(parents=True, exist_ok=True)
    running = read_servers(work_dir)
    if running:
        _remember(folder.parent)
        return running
    for port in (prefect_port, mlflow_port):
        if not _port_free(port):
            raise KilnError(f"port {port} on {HOST} is in use: stop what holds it, or pick another with "
                            "--prefect-port / --mlflow-port")

    prefect_env = {**os.environ, "PREFECT_HOME": str(folder / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_UI_API_URL": f"http://{HOST}:{prefect_port}/api"}
    prefect_env.pop("PREFECT_API_URL", None)  # the server must not look for itself elsewhere
    if prefect_database:
        prefect_env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = prefect_database
    mlflow_store = mlflow_database or f"sqlite:///{folder / 'mlflow.db'}"
    commands = {
        "prefect": (_python_tool("prefect") + ["server", "start", "--host", HOST, "--port", str(prefect_port)],
                    prefect_env, f"http://{HOST}:{prefect_port}/api", f"http://{HOST}:{prefect_port}",
                    f"http://{HOST}:{prefect_port}/api/health"),
        "mlflow": (_python_tool("mlflow") + ["server", "--host", HOST, "--port", str(mlflow_port), "--workers", "1",
                                             "--backend-store-uri", mlflow_store,
                                             "--artifacts-destination", str(folder / "mlartifacts")],
                   dict(os.environ), f"http://{HOST}:{mlflow_port}", f"http://{HOST}:{mlflow_port}",
                   f"http://{HOST}:{mlflow_port}/health"),
    }
    servers = []
    for name, (command, env, url, ui, health) in commands.items():
        pid, log = _spawn(name, command, env, folder)
        servers.append(Server(name, pid, url, ui, health, str(log)))
    _write_state(folder, servers)
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while not _healthy(server.health):
            if not pid_alive(server.pid):
                stop_servers(work_dir)
                raise KilnError(f"the {server.name} server exited while starting; its log: {server.log}")
            if time.monotonic() > deadline:
                stop_servers(work_dir)
                raise KilnError(f"the {server.name} server was not healthy after {timeout_s:.0f}s; its log: {server.log}")
            time.sleep(0.5)
    _remember(folder.parent)
    return servers


def _write_state(folder: Path, servers: list[Server]) -> None:
    (folder / STATE_FILE).write_text(json.dumps([asdict(s) for s in servers], indent=2))
    urls = {s.name: s.url for s in servers}
    (folder / ENV_FILE).write_text(f"export PREFECT_API_URL={urls['prefect']}\n"
                                   f"export MLFLOW_TRACKING_URI={urls['mlflow']}\n"
                                   f"export PREFECT_HOME={folder.parent / 'prefect'}\n")


def read_servers(work_dir: str | Path) -> list[Server]:
    """The servers `up` started for this working directory that are still alive."""
    state = servers_dir(work_dir) / STATE_FILE
    if not state.is_file():
        return []
    servers = [Server(**entry) for entry in json.loads(state.read_text())]
    return servers if all(pid_alive(s.pid) for s in servers) else []


def stop_servers(work_dir: str | Path, timeout_s: float = 30.0) -> list[str]:
    """SIGTERM each server's process group, then SIGKILL what is left; returns the names stopped."""
    state = servers_dir(work_dir) / STATE_FILE
    if not state.is_file():
        return []
    servers = [Server(**entry) for entry in json.loads(state.read_text())]
    stopped = []
    for server in servers:
        if not pid_alive(server.pid):
            continue
        _signal_group(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(server.pid) and time.monotonic() < deadline:
            _reap(server.pid)
            time.sleep(0.2)
        _signal_group(server.pid, signal.SIGKILL)
        _reap(server.pid)
        stopped.append(server.name)
    state.unlink()
    (servers_dir(work_dir) / ENV_FILE).unlink(missing_ok=True)
    _forget(Path(work_dir).resolve())
    return stopped


def _registry() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "kiln" / "servers.json"


@contextmanager
def _registry_entries() -> Iterator[list[str]]:
    """The recorded working directories (oldest `up` first), under a lock; changes are written back."""
    path = _registry()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = json.loads(path.read_text()) if path.is_file() else []
        before = list(entries)
        yield entries
        if entries != before:
            path.write_text(json.dumps(entries, indent=2))


def _remember(work_dir: Path) -> None:
    with _registry_entries() as entries:
        entries[:] = [e for e in entries if e != str(work_dir)] + [str(work_dir)]


def _forget(work_dir: Path) -> None:
    with _registry_entries() as entries:
        entries[:] = [e for e in entries if e != str(work_dir)]


def running_work_dirs() -> list[Path]:
    """The working directories whose servers `up` started and that still run, the last `up` first;
    entries whose servers are gone are dropped."""
    with _registry_entries() as entries:
        entries[:] = [e for e in entries if read_servers(e)]
        return [Path(e) for e in reversed(entries)]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    """Collect the exit status when this process started the server (else it lingers as a zombie)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
