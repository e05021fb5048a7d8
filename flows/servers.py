"""`kiln up` / `kiln down`: a local Prefect server and MLflow tracking server for one working directory.

Both bind to 127.0.0.1 and keep their state under `{work_dir}/servers/` (SQLite databases, logs,
pid files), unless a database URL (a team's PostgreSQL) is given. `up` returns once both answer their
health checks and writes `servers/env`, the variables through which every later `kiln` command,
worker and deployment finds them (`PREFECT_API_URL`, `MLFLOW_TRACKING_URI`) and keeps its Prefect
client state in the working directory (`PREFECT_HOME={work_dir}/prefect`, not ~/.prefect).
Without those variables Kiln falls back to its embedded defaults.

With `--database postgres` both servers keep their records in a PostgreSQL cluster of Kiln's own
under `servers/postgres` (`flows.database`), started first and stopped last; a cluster once created
is used by every later `up` of the working directory. A server that died while the others still run
is started again by the next `up`, as it was (same port, same database), so clients' URLs stay right.
The state file records how each server was started, passwords included: it is owner-only.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.flows import database
from kiln.tasks.errors import KilnError
from kiln.tasks.keylock import pid_alive

HOST = "127.0.0.1"
STATE_FILE = "servers.json"
LAST_STATE_FILE = "servers.last.json"  # what `down` stopped: the next `up` starts them on the same ports
ENV_FILE = "env"
LOG_MARK = "---- kiln up starts"  # written to a server's log before each start: its tail is this start's
WORKERS_DIR = "workers"  # under servers/: one file per running `kiln worker` of these servers, named by its pid
REAPER_FILE = "reaper.json"  # under servers/: the reaper `up` started beside the servers (pid, command)
REAP_EVERY_S = 30  # how often the reaper marks what a crash left running
WORKER_STOP_S = 10.0  # how long a worker may take to stop on SIGTERM (`kiln worker` kills its Prefect worker then)


@dataclass(frozen=True)
class Server:
    name: str
    pid: int
    url: str  # what clients set (PREFECT_API_URL, MLFLOW_TRACKING_URI)
    ui: str
    health: str
    log: str
    command: list[str] = field(default_factory=list)  # how `up` starts it again if it dies
    env: dict[str, str] = field(default_factory=dict)  # its variables beyond Kiln's own environment
    user: str | None = None  # the account it runs as, when not Kiln's (PostgreSQL's, as root)


def servers_dir(work_dir: str | Path) -> Path:
    return Path(work_dir).resolve() / "servers"


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((HOST, port)) != 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _healthy(server: Server, folder: Path) -> bool:
    if server.name == "postgres":
        return database.ready(int(server.url.rsplit(":", 1)[1]), database.read_secrets(folder)["PGPASSWORD"])
    try:
        with urllib.request.urlopen(server.health, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _python_tool(module: str) -> list[str]:
    """The server CLIs of the interpreter running Kiln (its venv), whatever is first on PATH."""
    return [sys.executable, "-m", module]


def _alive(pid: int) -> bool:
    _reap(pid)  # a server this process started and that died is a zombie until collected
    return pid_alive(pid)


def _spawn(server: Server) -> Server:
    """Start `server` as recorded (command, variables, account); returns it with its new pid."""
    env = {**os.environ, **server.env}
    env.pop("PREFECT_API_URL", None)  # a server must not look for itself elsewhere
    with open(server.log, "ab") as out:
        out.write(f"{LOG_MARK} {server.name}: {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        out.flush()
        # its own process group: `down` stops the server and every worker process it forked
        process = subprocess.Popen(server.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, user=server.user,
                                   group=server.user, extra_groups=[] if server.user else None)
    return Server(**{**asdict(server), "pid": process.pid})


def _log_tail(path: str | Path, lines: int = 12) -> str:
    """The last lines of a server's log since its latest start (not an earlier server's), indented: why it
    exited is usually there."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError as error:
        return f"  (unreadable: {error})"
    starts = [i for i, line in enumerate(text) if line.startswith(LOG_MARK)]
    text = text[starts[-1] + 1:][-lines:] if starts else text[-lines:]
    return "\n".join(f"  {line}" for line in text) or "  (empty)"


def _wait_healthy(work_dir: str | Path, servers: list[Server], timeout_s: float) -> None:
    folder = servers_dir(work_dir)
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while not _healthy(server, folder):
            if not _alive(server.pid):
                stop_servers(work_dir)
                raise KilnError(f"the {server.name} server exited while starting; the end of its log "
                                f"({server.log}):\n{_log_tail(server.log)}")
            if time.monotonic() > deadline:
                stop_servers(work_dir)
                raise KilnError(f"the {server.name} server was not healthy after {timeout_s:.0f}s; its log: {server.log}")
            time.sleep(0.5)


def _postgres(folder: Path) -> tuple[Server, tuple[str, str]]:
    """Kiln's PostgreSQL, created on first use, not yet started; and the servers' URLs to it."""
    password = database.prepare(folder)
    port = _free_port()
    database.write_secrets(folder, password, port)
    server = Server("postgres", 0, f"postgresql://{database.ROLE}@{HOST}:{port}", f"{HOST}:{port}", "",
                    str(folder / "postgres.log"), database.server_command(folder, port), {}, database.account())
    return server, database.urls(port, password)


def start_servers(work_dir: str | Path, *, prefect_port: int | None = None, mlflow_port: int | None = None,
                  prefect_database: str | None = None, mlflow_database: str | None = None,
                  database_kind: str | None = None, timeout_s: float = 120.0,
                  restarted: list[str] | None = None) -> list[Server]:
    """Start both servers (or report the running ones) and wait until they are healthy. `database_kind`:
    `sqlite`, `postgres` (Kiln's own cluster), or None: the cluster if this work dir has one, else SQLite.
    Servers of an earlier `up` that died (all of them, or some while others still run) are started again
    as they were: same ports, same database, so clients' URLs and alert links stay right; their names are
    appended to `restarted`. Ports not given: those of the last `up` here, else 4200 and 5000."""
    folder = servers_dir(work_dir)
    folder.mkdir(parents=True, exist_ok=True)
    recorded = _recorded(folder)
    last = _recorded(folder, LAST_STATE_FILE)
    ports_given = prefect_port is not None or mlflow_port is not None
    if not any(_alive(s.pid) for s in recorded) and not recorded and last and not ports_given \
            and not (prefect_database or mlflow_database) and database_kind in (None, _kind_of(last)):
        recorded = last  # stopped by `down`: started again as they were
    if recorded and (any(_alive(s.pid) for s in recorded) or recorded is last or not ports_given):
        dead = [s for s in _start_order(recorded) if not _alive(s.pid)]
        for server in dead:
            if server.name == "postgres":
                database.wait_for_old_server(folder)
        servers = [s if _alive(s.pid) else _spawn(s) for s in _start_order(recorded)]
        _write_state(folder, servers)
        _wait_healthy(work_dir, _start_order(servers), timeout_s)
        _remember(folder.parent)
        if restarted is not None:
            restarted.extend(s.name for s in dead)
        return _stop_order(servers)
    prefect_port = 4200 if prefect_port is None else prefect_port
    mlflow_port = 5000 if mlflow_port is None else mlflow_port

    urls_given = bool(prefect_database or mlflow_database)
    postgres = database_kind == "postgres" or (database_kind is None and not urls_given and database.exists(folder))
    if postgres and urls_given:
        raise KilnError("--database postgres starts Kiln's own PostgreSQL; --prefect-database / --mlflow-database "
                        "(or $KILN_PREFECT_DATABASE / $KILN_MLFLOW_DATABASE) name another: give one or the other")
    for port in (prefect_port, mlflow_port):
        if not _port_free(port):
            raise KilnError(f"port {port} on {HOST} is in use: stop what holds it, or pick another with "
                            "--prefect-port / --mlflow-port")
    servers = []
    if postgres:
        server, (prefect_database, mlflow_database) = _postgres(folder)
        servers.append(_spawn(server))
        _write_state(folder, servers)
        _wait_healthy(work_dir, servers, timeout_s)

    prefect_env = {"PREFECT_HOME": str(folder / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_UI_API_URL": f"http://{HOST}:{prefect_port}/api",
                   # the server drops the events it could not write after 5 flushes (~25 s): hold them
                   # through a database restart (60 flushes, ~5 min)
                   "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_MAX_FLUSH_RETRIES": "60"}
    if prefect_database:
        prefect_env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = prefect_database
    # the store's URL goes in the environment, not on the command line, where `ps` shows any password
    # MLflow 3's job runner (seven huey consumers, ~260 MB each, for GenAI evaluation jobs Kiln never
    # submits) is left off: fewer processes to start, hold memory and outlive a killed server
    mlflow_env = {"MLFLOW_BACKEND_STORE_URI": mlflow_database or f"sqlite:///{folder / 'mlflow.db'}",
                  "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for server in (
        Server("prefect", 0, f"http://{HOST}:{prefect_port}/api", f"http://{HOST}:{prefect_port}",
               f"http://{HOST}:{prefect_port}/api/health", str(folder / "prefect.log"),
               _python_tool("prefect") + ["server", "start", "--host", HOST, "--port", str(prefect_port)], prefect_env),
        Server("mlflow", 0, f"http://{HOST}:{mlflow_port}", f"http://{HOST}:{mlflow_port}",
               f"http://{HOST}:{mlflow_port}/health", str(folder / "mlflow.log"),
               _python_tool("mlflow") + ["server", "--host", HOST, "--port", str(mlflow_port), "--workers", "1",
                                         "--artifacts-destination", str(folder / "mlartifacts")], mlflow_env),
    ):
        servers.append(_spawn(server))
    _write_state(folder, servers)
    _wait_healthy(work_dir, servers, timeout_s)
    _remember(folder.parent)
    return _stop_order(servers)


def _start_order(servers: list[Server]) -> list[Server]:
    """The database first: both servers need it."""
    return sorted(servers, key=lambda s: s.name != "postgres")


def _stop_order(servers: list[Server]) -> list[Server]:
    """The database last: both servers write to it until they stop."""
    return sorted(servers, key=lambda s: s.name == "postgres")


def _write_state(folder: Path, servers: list[Server]) -> None:
    _write_private(folder / STATE_FILE, json.dumps([asdict(s) for s in _stop_order(servers)], indent=2))
    urls = {s.name: s.url for s in servers}
    if {"prefect", "mlflow"} <= urls.keys():
        _write_private(folder / ENV_FILE, f"export PREFECT_API_URL={urls['prefect']}\n"
                                          f"export MLFLOW_TRACKING_URI={urls['mlflow']}\n"
                                          f"export PREFECT_HOME={folder.parent / 'prefect'}\n")


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (the state holds database passwords)."""
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def _recorded(folder: Path, name: str = STATE_FILE) -> list[Server]:
    state = folder / name
    return [Server(**entry) for entry in json.loads(state.read_text())] if state.is_file() else []


def _kind_of(servers: list[Server]) -> str:
    return "postgres" if any(s.name == "postgres" for s in servers) else "sqlite"


def read_servers(work_dir: str | Path) -> list[Server]:
    """The servers `up` started for this working directory, if all are still alive."""
    servers = _recorded(servers_dir(work_dir))
    return servers if all(_alive(s.pid) for s in servers) else []


def stop_servers(work_dir: str | Path, timeout_s: float = 30.0) -> list[str]:
    """Stop each server (SIGTERM to its process group; PostgreSQL, last, gets SIGINT, its fast shutdown),
    then SIGKILL what is left; returns the names stopped."""
    folder = servers_dir(work_dir)
    stopped = []
    for server in _stop_order(_recorded(folder)):
        if not _alive(server.pid):
            continue
        if server.name == "postgres":
            os.kill(server.pid, signal.SIGINT)  # the postmaster stops its own processes
        else:
            _signal_group(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(server.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(server.pid, signal.SIGKILL)
        _reap(server.pid)
        stopped.append(server.name)
    if (folder / STATE_FILE).is_file():  # kept (owner-only): the next `up` starts them as they were
        os.replace(folder / STATE_FILE, folder / LAST_STATE_FILE)
    (folder / ENV_FILE).unlink(missing_ok=True)
    _forget(Path(work_dir).resolve())
    return stopped


def servers_of(prefect_api_url: str) -> Path | None:
    """The servers folder of the running `kiln up` whose Prefect API is `prefect_api_url` (None: not Kiln's)."""
    for work_dir in running_work_dirs():
        if any(s.name == "prefect" and s.url == prefect_api_url.rstrip("/") for s in read_servers(work_dir)):
            return servers_dir(work_dir)
    return None


def register_worker(folder: Path, pid: int) -> Path:
    """Record a running `kiln worker` of the servers in `folder`, so `kiln down` finds it; returns its file."""
    path = folder / WORKERS_DIR / str(pid)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "started": time.time()}))
    return path


def stop_workers(work_dir: str | Path, timeout_s: float = WORKER_STOP_S + 5) -> tuple[list[int], list[int]]:
    """SIGTERM every recorded `kiln worker` of this work dir's servers (each stops within `WORKER_STOP_S`,
    leaving the flow runs it started running) and wait for them; returns (stopped, still running) pids."""
    folder = servers_dir(work_dir) / WORKERS_DIR
    pids = sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.is_dir() else []
    live = [pid for pid in pids if pid_alive(pid)]
    for pid in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in live) and time.monotonic() < deadline:
        time.sleep(0.2)
    still = [pid for pid in live if _alive(pid)]
    for pid in pids:
        if pid not in still:
            (folder / str(pid)).unlink(missing_ok=True)
    return [pid for pid in live if pid not in still], still


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


def start_reaper(work_dir: str | Path, config_args: list[str]) -> tuple[int, bool]:
    """Start the reaper beside the running servers unless it runs: `kiln reap --every 30s` on the config
    `config_args` name (its MLflow experiment), pointed at these servers, its output in servers/reaper.log.
    It marks what a crash left running with no worker or flow around (`flows.crashes`). Returns its pid
    and whether it was started again now after it died (`down` removes its record: not a restart)."""
    folder = servers_dir(work_dir)
    record = folder / REAPER_FILE
    died = record.is_file()
    if died:
        pid = json.loads(record.read_text())["pid"]
        if _alive(pid):
            return pid, False
    urls = {s.name: s.url for s in _recorded(folder)}
    env = {**os.environ, "PREFECT_API_URL": urls["prefect"], "MLFLOW_TRACKING_URI": urls["mlflow"],
           "PREFECT_HOME": str(folder.parent / "prefect")}
    command = [sys.executable, "-m", "kiln.flows.cli", "reap", "--every", f"{REAP_EVERY_S}s", *config_args,
               f"work_dir={folder.parent}"]
    with open(folder / "reaper.log", "ab") as out:
        out.write(f"{LOG_MARK} reaper: {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        out.flush()
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    _write_private(record, json.dumps({"pid": process.pid, "command": command}))
    return process.pid, died


def stop_reaper(work_dir: str | Path) -> int | None:
    """Stop the reaper of these servers (SIGTERM, then SIGKILL); returns its pid, None when none ran."""
    record = servers_dir(work_dir) / REAPER_FILE
    if not record.is_file():
        return None
    pid = json.loads(record.read_text())["pid"]
    record.unlink()
    if not _alive(pid):
        return None
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(pid, signal.SIGKILL)
    _reap(pid)
    return pid
