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
from pathlib import Path

from tasks.config import KilnConfig


def prepare_environment(cfg: KilnConfig) -> None:
    """Set the environment every later import of Prefect/MLflow/lm-eval reads. Idempotent."""
    work_dir = Path(cfg.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work_dir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", cfg.log_level)
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "false")
    if not cfg.evaluate.extra_tasks:
        # Kiln's local eval tasks need no hub; built-in lm-eval tasks (evaluate.extra_tasks) do.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger().setLevel(cfg.log_level)
    _create_prefect_database(Path(os.environ["PREFECT_HOME"]))


def _create_prefect_database(home: Path) -> None:
    """Create the embedded API's SQLite schema once, under a lock: two runs started at once on a new
    working directory would otherwise both migrate it. With a server configured there is nothing to do."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    database = settings.server.database.connection_url
    if settings.api.url or database is None or not database.get_secret_value().startswith("sqlite"):
        return
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".kiln-init.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "prefect.db").exists():
            from prefect.server.database import provide_database_interface

            asyncio.run(provide_database_interface().create_db())
