"""Pin Prefect's and MLflow's state to the run's working directory, before Prefect is imported.

Library defaults (`~/.prefect`, `./mlruns`, `./mlflow.db`) would mix runs of different
working directories; Kiln keeps the store, the MLflow database and artifacts, and
`PREFECT_HOME` under one folder so a run is self-contained, movable and deletable.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from tasks.config import KilnConfig


def prepare_environment(cfg: KilnConfig) -> None:
    """Set the environment every later import of Prefect/MLflow/lm-eval reads. Idempotent."""
    work_dir = Path(cfg.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    if "prefect" in sys.modules and os.environ.get("PREFECT_HOME") != str(work_dir / "prefect"):
        # Prefect reads its settings at import; a second working directory in one process needs a new process.
        logging.getLogger(__name__).debug("prefect already imported; PREFECT_HOME unchanged")
    os.environ.setdefault("PREFECT_HOME", str(work_dir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", cfg.log_level)
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "false")
    os.environ.setdefault("MLFLOW_TRACKING_URI", cfg.tracking_uri)
    # Nothing may be fetched from a model/data hub at run time; lm-eval's local json tasks need no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger().setLevel(cfg.log_level)
