"""Pin Prefect's and MLflow's state to the run's working directory, before Prefect is imported.

Library defaults (`~/.prefect`, `./mlruns`, `./mlflow.db`) would mix runs of different
working directories; Kiln keeps the store, the MLflow database and artifacts, and
`PREFECT_HOME` under one folder so a run is self-contained, movable and deletable.
"""

from __future__ import annotations

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
    os.environ.setdefault("MLFLOW_TRACKING_URI", cfg.tracking_uri)
    if not cfg.evaluate.extra_tasks:
        # Kiln's local eval tasks need no hub; built-in lm-eval tasks (evaluate.extra_tasks) do.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger().setLevel(cfg.log_level)
