"""What several stage declarations share (`kiln.tasks.stages._common`): where data pipelines run."""

from __future__ import annotations

from kiln.tasks.config import load_config
from kiln.tasks.data.executors import ExecutorSettings
from kiln.tasks.ledger import StageRecorder
from kiln.tasks.stage import StageContext
from kiln.tasks.stages._common import executor_settings
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker


def context(tmp_path, *overrides: str) -> StageContext:
    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}", *overrides])
    recorder = StageRecorder(NullTracker(), "run", "clean", "key")
    return StageContext(cfg, tmp_path, {}, Store(tmp_path), recorder)


def test_the_cluster_section_decides_where_data_pipelines_run(tmp_path):
    local = executor_settings(context(tmp_path))
    assert local == ExecutorSettings("local") and local.on_job is not None  # jobs are recorded wherever they run
    slurm = executor_settings(context(tmp_path, "cluster.executor=slurm", "cluster.partition=cpu",
                                      "cluster.time_limit=01:00:00", "cluster.slurm.account=proj",
                                      "cluster.image=kiln:0.1.0-cpu"))
    assert (slurm.kind, slurm.partition, slurm.time_limit, slurm.slurm.account, slurm.image) == (
        "slurm", "cpu", "01:00:00", "proj", "kiln:0.1.0-cpu")
    # the Slurm fields mean nothing to the other executors
    assert executor_settings(context(tmp_path, "cluster.executor=ray", "cluster.partition=cpu")) == ExecutorSettings("ray")
