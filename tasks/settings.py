"""The settings every run has, whatever its stages: where it works, its store, tracking, orchestration,
cluster and continuous eval (`KilnConfig`). Each registered stage adds its own section to it
(`kiln.tasks.config.config_model`), so this is the bottom of the stage layer: stage declarations,
which name the whole tree's type, import it; loading a config file, which needs every stage, sits
above them in `kiln.tasks.config`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.evals.continuous import ContinuousEvalConfig
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.tracking import MlflowTracker


class StoreConfig(Section):
    """Where stage outputs live: `{root}/{stage}/{key}/`. Default: `{work_dir}/store`."""

    root: str | None = runtime_field(None)


class TrackingConfig(Section):
    """MLflow. Default URI: an SQLite file in the working directory (never the library default)."""

    uri: str | None = runtime_field(None)
    experiment: str = runtime_field("kiln")
    # how long a write that hit a database lock (SQLite's `database is locked`) is retried before it is
    # kept in the store's spool (<store>/.tracking-spool) and written when MLflow can take it
    write_retry_s: float = runtime_field(60.0, gt=0)


class OrchestrationConfig(Section):
    """How Prefect runs each stage task. Retries apply to unexpected failures only (a crashed worker,
    a lost filesystem); a user error (bad config or input, a failed gate) fails at once."""

    retries: int = runtime_field(1, ge=0)
    retry_delay_seconds: float = runtime_field(10.0, ge=0)
    lock_timeout_s: float | None = runtime_field(None, gt=0)  # None: wait for another run's same key forever


class ClusterConfig(ClusterSpec):
    """How and where work is launched; never part of a key (it changes where work runs, not its result).

    `launcher` runs the training stages (train, validate, anneal): `local` trains in this process
    when the layout is one process and under local torchrun otherwise; `torchrun` always goes through
    torchrun; `slurm` submits an sbatch job (torchrun under srun) and follows it; `kubernetes` applies
    an indexed Job with kubectl. `executor` runs the data stages (clean, dedup) on datatrove's local,
    Slurm or Ray executor. The hardware fields describe the cluster to the parallelism planner
    (`train.parallel: auto`, `kiln plan`).
    """

    executor: Literal["local", "slurm", "ray"] = runtime_field("local")
    launcher: Literal["local", "torchrun", "slurm", "kubernetes"] = runtime_field("local")


class KilnConfig(Section):
    """The settings of a whole run. Each registered stage adds its own section (see `config_model`)."""

    work_dir: str = runtime_field("kiln-work")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = runtime_field("WARNING")
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    cluster: ClusterConfig = ClusterConfig()
    continuous_eval: ContinuousEvalConfig = ContinuousEvalConfig()

    model_config = Section.model_config | {"populate_by_name": True}

    @property
    def store_root(self) -> Path:
        return Path(self.store.root or Path(self.work_dir) / "store")

    @property
    def tracking_uri(self) -> str:
        """`tracking.uri`, else $MLFLOW_TRACKING_URI (how `kiln up`'s server is found), else SQLite in work_dir."""
        return (self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
                or f"sqlite:///{(Path(self.work_dir) / 'mlflow.db').resolve()}")

    def section(self, name: str) -> Section:
        """The section at the config key `name` (`validate` lives in the attribute `validate_`)."""
        field = next((f for f, info in type(self).model_fields.items() if (info.alias or f) == name), name)
        return getattr(self, field)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)




def open_tracker(cfg: KilnConfig) -> MlflowTracker:
    """The MLflow tracker of `cfg`'s store and experiment (`MlflowTracker.shared`: one per process)."""
    return MlflowTracker.shared(cfg.tracking_uri, cfg.tracking.experiment, work_dir=Path(cfg.work_dir),
                                store_root=cfg.store_root, write_retry_s=cfg.tracking.write_retry_s)
