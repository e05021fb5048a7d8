"""Pin Prefect's and MLflow's state to the run's working directory, before Prefect is imported.

Library defaults (`~/.prefect`, `./mlruns`, `./mlflow.db`) would mix runs of different
working directories; Kiln keeps the store, the MLflow database and artifacts, and
`PREFECT_HOME` under one folder so a run is self-contained, movable and deletable.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sys
from pathlib import Path

from kiln.flows import embedded_api
from kiln.tasks.settings import KilnConfig

# Every Kiln process gets these, whoever starts it (the CLI, a worker's flow-run process, `kiln serve`).
PROCESS_SETTINGS = {
    # OpenMP threads that spin while waiting make torch on a busy 2-core machine ~10x slower
    # (measured: 4.0 s vs 0.4 s per step); must be set before torch loads libgomp.
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    # A Prefect server whose database is down (restarting) answers 500, which Prefect's client does not
    # retry by default (only 429, 502, 503): an artifact or a state change then fails the flow run.
    # Retried with Prefect's backoff (5 tries, ~1 min in all); a real server error still fails after.
    "PREFECT_CLIENT_RETRY_EXTRA_CODES": "500",
}


def apply_run_settings(cfg: KilnConfig) -> None:
    """The settings a run's config implies, for the process that runs it (CLI or flow-run process);
    inside a flow run, also where Prefect keeps its results (`keep_results_in_work_dir`)."""
    for name, value in PROCESS_SETTINGS.items():
        os.environ.setdefault(name, value)
    keep_results_in_work_dir(cfg)
    keep_console_in_work_dir(cfg)
    evaluate = getattr(cfg, "evaluate", None)  # a registry without the evaluate stage has no section
    if evaluate is None or not evaluate.online_tasks():
        # Kiln's local eval tasks need no hub; lm-eval's (evaluate.standard_suite, extra_tasks) do.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    logging.getLogger().setLevel(cfg.log_level)


def results_dir(cfg: KilnConfig) -> Path:
    """Where a run's Prefect results live: `PREFECT_HOME/storage` of a CLI run in this work dir."""
    return Path(cfg.work_dir).resolve() / "prefect" / "storage"


def keep_results_in_work_dir(cfg: KilnConfig) -> None:
    """Point the current flow run's result store (where Prefect persists its return value or its
    exception) at `results_dir(cfg)`. A worker's flow-run process was started before its config was
    read, with the worker's PREFECT_HOME (by default ~/.prefect): its results would land there, outside
    the run's work dir. Prefect reads the store from the run context when the run ends, so replacing it
    there is enough; subflows inherit it. Outside a flow run (as before Prefect is imported), nothing to do."""
    if "prefect.context" not in sys.modules:  # not in a flow run; and the CLI must not import Prefect yet
        return
    from prefect.context import FlowRunContext
    from prefect.filesystems import LocalFileSystem

    context = FlowRunContext.get()
    if context is None or context.result_store is None:
        return
    folder = results_dir(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    context.result_store = context.result_store.model_copy(
        update={"result_storage": LocalFileSystem(basepath=str(folder))})


def keep_console_in_work_dir(cfg: KilnConfig) -> None:
    """A flow run started without a console (a worker's, whose pool does not stream its output: see
    infra/prefect.yaml) writes its stdout and stderr to `{work_dir}/logs/flow-runs/{flow run id}.log`,
    appended to by each attempt. Elsewhere (a console, a pipe, a file), nothing changes."""
    if "prefect.context" not in sys.modules:
        return
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None or not _is_devnull(1):
        return
    folder = Path(cfg.work_dir).resolve() / "logs" / "flow-runs"
    folder.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    descriptor = os.open(folder / f"{context.flow_run.id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def _is_devnull(descriptor: int) -> bool:
    try:
        found, null = os.fstat(descriptor), os.stat(os.devnull)
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (null.st_dev, null.st_ino)


def prepare_environment(cfg: KilnConfig) -> None:
    """Set the environment every later import of Prefect/MLflow/lm-eval reads, and start the
    run's Prefect API unless a server is configured. For the CLI, before Prefect is imported."""
    work_dir = Path(cfg.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work_dir / "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", cfg.log_level)
    apply_run_settings(cfg)
    home = Path(os.environ["PREFECT_HOME"])
    if "prefect" in sys.modules:  # imported already (a notebook, the tests): its settings decide
        if _embedded_sqlite_from_settings():
            _create_sqlite_schema(home)
        return
    if _server_configured(home):
        return
    embedded_api.reserve()  # before Prefect is first imported: its settings read PREFECT_API_URL once
    if not _database_url().startswith(("postgresql", "mysql")):
        _create_sqlite_schema(home)
    embedded_api.start()


def _database_url() -> str:
    return (os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL")
            or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or "sqlite")


def _server_configured(home: Path) -> bool:
    """A Prefect server given by the environment or by the profile in PREFECT_HOME."""
    profiles = home / "profiles.toml"
    return "PREFECT_API_URL" in os.environ or (profiles.is_file() and "PREFECT_API_URL" in profiles.read_text())


def _embedded_sqlite_from_settings() -> bool:
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    database = settings.server.database.connection_url
    return not settings.api.url and database is not None and database.get_secret_value().startswith("sqlite")


def _create_sqlite_schema(home: Path) -> None:
    """Create the embedded API's SQLite schema once, under a lock: two runs started at once on a new
    working directory would otherwise both migrate it."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".kiln-init.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "prefect.db").exists():
            from prefect.server.database import provide_database_interface

            asyncio.run(provide_database_interface().create_db())
