"""Kiln's own PostgreSQL for `kiln up --database postgres`: one cluster under `{work_dir}/servers/postgres`
holding the Prefect server's and the MLflow tracking server's records.

SQLite serves one user's runs; several pipelines, sweeps and scheduled flows on one server need a
database that takes concurrent writers (PrefectHQ/prefect issues 7277, 10188, 17473: `database is locked`).
The binaries come from Debian's `postgresql` package (`infra/system-packages.sh`). On first use the
cluster is created (initdb) with one role, `kiln`, whose generated password is kept in
`servers/database.env`, readable by its owner only, and never put on a command line; the server listens
on 127.0.0.1 only, on a port free when it starts, with no Unix socket, and holds two databases,
`prefect` and `mlflow`. The cluster outlives `kiln down`: it is the history of the runs.

PostgreSQL refuses to run as root, so as root Kiln runs it as the `postgres` account the package
creates, which then owns the cluster's folder and must be able to reach it.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from kiln.tasks.errors import KilnError

HOST = "127.0.0.1"
ROLE = "kiln"
DATABASES = ("prefect", "mlflow")
CLUSTER_DIR = "postgres"  # under servers/
SECRETS_FILE = "database.env"  # under servers/, mode 0600
ACCOUNT = "postgres"  # Debian's package creates it; the server's account when Kiln runs as root
_DEBIAN_BINARIES = Path("/usr/lib/postgresql")  # /usr/lib/postgresql/<major>/bin: not on PATH


def binary(tool: str) -> str:
    """`tool` (initdb, postgres) of the newest PostgreSQL installed."""
    majors = sorted((p for p in _DEBIAN_BINARIES.glob("*/bin") if (p / tool).is_file()),
                    key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    found = str(majors[-1] / tool) if majors else shutil.which(tool)
    if found is None:
        raise KilnError(f"PostgreSQL's {tool} is not installed: run `bash infra/system-packages.sh` (Debian's "
                        "postgresql package), or give your own database with --prefect-database and --mlflow-database")
    return found


def exists(servers: Path) -> bool:
    """Whether this working directory has a cluster of Kiln's (so `kiln up` uses it again)."""
    return (servers / CLUSTER_DIR / "PG_VERSION").is_file()


def account() -> str | None:
    """The account the server runs as: None for this process's own, `postgres` when running as root."""
    return ACCOUNT if os.geteuid() == 0 else None


def prepare(servers: Path) -> str:
    """The cluster under `servers`, created on first use; returns its role's password."""
    cluster, secrets_file = servers / CLUSTER_DIR, servers / SECRETS_FILE
    if exists(servers):
        if not secrets_file.is_file():
            raise KilnError(f"the PostgreSQL cluster in {cluster} needs its password, kept in {secrets_file}, which "
                            f"is gone: restore that file, or remove {cluster} to start a new one (its records are lost)")
        return read_secrets(servers)["PGPASSWORD"]
    user = account()
    cluster.mkdir(mode=0o700, exist_ok=True)
    if any(cluster.iterdir()):
        raise KilnError(f"{cluster} holds files but no PostgreSQL cluster (no PG_VERSION): move them away, then kiln up")
    if user is not None:
        _give_to(cluster, user)
        _check_reachable(cluster, user)
    password = secrets.token_urlsafe(24)  # URL-safe: it goes into the servers' connection URLs as it is
    write_secrets(servers, password, port=None)
    password_file = servers / ".initdb-password"
    password_file.write_text(password + "\n")
    os.chmod(password_file, 0o600)
    if user is not None:
        _give_to(password_file, user)
    try:
        done = subprocess.run([binary("initdb"), "-D", str(cluster), "-U", ROLE, f"--pwfile={password_file}",
                               "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "-E", "UTF8",
                               "--no-locale", "--no-instructions"],
                              capture_output=True, text=True, user=user, group=user, extra_groups=[] if user else None)
    finally:
        password_file.unlink()
    if done.returncode != 0:
        shutil.rmtree(cluster, ignore_errors=True)  # half a cluster would stop the next `kiln up`
        raise KilnError(f"initdb failed for {cluster}:\n{done.stderr.strip()[-2000:]}")
    return password


def wait_for_old_server(servers: Path, timeout_s: float = 60.0) -> None:
    """Before starting the cluster again after its server died: wait until the dead server's processes
    (backends, background workers: each notices its postmaster's death on its own, seconds later) have
    ended; a new server refuses the cluster while they still hold its shared memory."""
    import psutil  # defers psutil

    cluster = (servers / CLUSTER_DIR).resolve()

    def holders() -> list[int]:
        found = []
        for process in psutil.process_iter(["pid", "cwd"]):
            if process.info["cwd"] and Path(process.info["cwd"]) == cluster:
                found.append(process.info["pid"])
        return found

    deadline = time.monotonic() + timeout_s
    while (left := holders()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        raise KilnError(f"the PostgreSQL processes of a server that died ({', '.join(map(str, left))}) still use "
                        f"{cluster} after {timeout_s:.0f}s: stop them (kill {' '.join(map(str, left))}), then kiln up")


def server_command(servers: Path, port: int) -> list[str]:
    """The server on 127.0.0.1:`port` only; no Unix socket (a work dir's path is often longer than a
    socket's 107 characters, and the system's socket folder is another cluster's)."""
    return [binary("postgres"), "-D", str(servers / CLUSTER_DIR), "-p", str(port), "-c", f"listen_addresses={HOST}",
            "-c", "unix_socket_directories="]


def urls(port: int, password: str) -> tuple[str, str]:
    """The Prefect server's and the MLflow server's database URLs (Prefect's driver is asyncpg, MLflow's,
    through SQLAlchemy, psycopg 3)."""
    where = f"{ROLE}:{password}@{HOST}:{port}"
    return f"postgresql+asyncpg://{where}/prefect", f"postgresql+psycopg://{where}/mlflow"


def ready(port: int, password: str) -> bool:
    """Whether the server takes connections; once it does, its two databases are created if missing."""
    import psycopg

    try:
        with psycopg.connect(host=HOST, port=port, user=ROLE, password=password, dbname="postgres",
                             connect_timeout=2, autocommit=True) as connection:
            present = {row[0] for row in connection.execute("SELECT datname FROM pg_database")}
            for name in DATABASES:
                if name not in present:
                    connection.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        return False
    return True


def write_secrets(servers: Path, password: str, port: int | None) -> None:
    """`servers/database.env`, owner-only: the role and password (and the port the server last started
    on), as libpq's variables, so `source servers/database.env; psql prefect` connects."""
    lines = [f"# Kiln's PostgreSQL ({servers / CLUSTER_DIR}): keep this file, the cluster needs its password",
             f"export PGUSER={ROLE}", f"export PGPASSWORD={password}", f"export PGHOST={HOST}"]
    if port is not None:
        lines.append(f"export PGPORT={port}")
    path = servers / SECRETS_FILE
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(temporary, path)


def read_secrets(servers: Path) -> dict[str, str]:
    entries = {}
    for line in (servers / SECRETS_FILE).read_text().splitlines():
        if line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            entries[name] = value
    return entries


def _give_to(path: Path, user: str) -> None:
    record = pwd.getpwnam(user)
    os.chown(path, record.pw_uid, record.pw_gid)


def _check_reachable(cluster: Path, user: str) -> None:
    """The server's account must enter every folder above its cluster."""
    def enters(folder: Path) -> bool:
        return subprocess.run(["test", "-x", str(folder)], user=user, group=user, extra_groups=[]).returncode == 0

    if enters(cluster):
        return
    blocked = next((folder for folder in reversed(cluster.parents) if not enters(folder)), cluster)
    shutil.rmtree(cluster, ignore_errors=True)
    raise KilnError(f"PostgreSQL does not run as root, so Kiln runs it as the `{user}` account, which cannot enter "
                    f"{blocked} (mode {blocked.stat().st_mode & 0o777:o}): let it (chmod o+x {blocked}), use a work dir "
                    f"it can reach, or run kiln as another user than root")
