"""Task-level retries on the real Slurm cluster: the clean stage on `cluster.executor: slurm`, one of its
Slurm ranks killed mid-stage. The rank's death is an infrastructure failure (`ExecutorError`, retryable),
so the stage's Prefect task is retried (`orchestration.retries`) and the retry resumes from the failed
attempt's partial folder: only the killed rank runs again, and the stage commits. (A killed sweep trial
is retried on its own, inside its stage: tests/tasks/scaling/test_sweep_cluster.py.)"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from kiln.flows.stages import flow_for
from kiln.tasks.config import load_config
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.graph import stage_keys
from kiln.tasks.runner import run_stage
from kiln.tasks.store import Store
from tests.processes import killing_first, slurm_job_steps

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]  # Slurm jobs on a busy machine

TINY = "configs/tiny.yaml"


def test_a_clean_stage_whose_slurm_rank_is_killed_is_retried_by_its_task_and_resumes(
        prefect_api, slurm_cluster, in_repo, tmp_path):
    overrides = [f"work_dir={tmp_path}", "cluster.executor=slurm", "orchestration.retries=1",
                 "orchestration.retry_delay_seconds=0", "clean.num_workers=2", "clean.quality_training=null",
                 "clean.quality_top_fraction=null", "collect.max_docs_per_source=4",
                 "collect.shard_bytes=250000"]  # two shards: clean runs a rank per shard
    cfg = load_config(TINY, overrides)
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    run_stage("collect", cfg, store=store, keys=keys)
    num_shards = len(shard_paths(store.path("collect", keys["collect"])))
    assert num_shards == 2
    # a rank of this cluster's clean job: its Python runs the executor's pickle in clean's partial folder
    pickle = store.partial_path("clean", keys["clean"]).resolve() / "_datatrove" / "logs" / "executor.pik"
    ranks = slurm_job_steps(slurm_cluster.env, argument=str(pickle))

    with killing_first(ranks) as killed:
        outcome = flow_for("clean")(config_path=TINY, overrides=overrides)
    assert killed, "no Slurm rank of the clean stage was seen running"
    assert outcome["status"] == "ran" and store.is_complete("clean", keys["clean"])
    attempts = store.manifest("clean", keys["clean"])["launch"]["runs"]["kiln_clean"]["attempts"]
    assert [len(a["ranks"]) for a in attempts] == [2, 1]  # both attempts' jobs; the retry ran only the killed rank
    runs = MlflowClient(cfg.tracking_uri).search_runs(
        [MlflowClient(cfg.tracking_uri).get_experiment_by_name("kiln").experiment_id],
        filter_string="tags.`kiln.stage` = 'clean'", order_by=["attributes.start_time ASC"])
    assert [(r.data.tags["kiln.status"], r.info.status) for r in runs] == [("failed", "FAILED"), ("ran", "FINISHED")]
    assert f"1 of {num_shards} ranks did not finish" in runs[0].data.tags["kiln.error"]
    assert store.manifest("clean", keys["clean"])["stats"]["num_kept"] > 0
