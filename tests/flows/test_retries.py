"""A retried pipeline flow run (what the UI's Retry and flow `retries=` do) reuses what succeeded,
redoes what failed, and stays one MLflow pipeline run tagged with the Prefect flow-run id."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

import flows.pipeline
import flows.stages
import tasks.stages
from tasks.config import load_config
from tasks.errors import KilnError
from tasks.stage import Registry, Stage, StageContext
from tasks.stages import collect

TOY = "tests/fixtures/toy.yaml"


def flaky_stage(failures: int) -> Stage:
    """A stage whose first `failures` attempts fail, as a stage does when a node or a file is briefly gone."""
    attempts = []

    def body(ctx: StageContext) -> dict:
        attempts.append(1)
        if len(attempts) <= failures:
            raise KilnError(f"flaky: attempt {len(attempts)} fails")
        (ctx.out_dir / "done.txt").write_text("ok")
        return {"num_attempts": len(attempts)}

    return Stage(name="flaky", description="fails first", body=body, inputs=("collect",))


def test_a_retried_flow_run_reuses_upstream_and_keeps_one_mlflow_parent(prefect_api, in_repo, tmp_path, monkeypatch):
    registry = Registry([collect.STAGE, flaky_stage(failures=1)])
    for module in (tasks.stages, flows.pipeline, flows.stages):
        monkeypatch.setattr(module, "REGISTRY", registry)
    overrides = [f"work_dir={tmp_path}"]

    outcomes = flows.pipeline.pipeline.with_options(retries=1)(TOY, overrides)

    assert [(o["stage"], o["status"]) for o in outcomes] == [("collect", "cached"), ("flaky", "ran")]
    cfg = load_config(TOY, overrides)
    client = MlflowClient(cfg.tracking_uri)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    parents = client.search_runs([experiment], filter_string="tags.`kiln.stage` = 'pipeline'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["kiln.attempt"] == "2"
    assert parent.data.tags["kiln.prefect_flow_run_id"] != "none"
    assert parent.info.run_name.startswith("pipeline/toy/")
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    attempts = sorted((r.data.tags["kiln.stage"], r.data.tags["kiln.status"], r.info.status) for r in children)
    assert attempts == [("collect", "cached", "FINISHED"), ("collect", "ran", "FINISHED"),
                        ("flaky", "failed", "FAILED"), ("flaky", "ran", "FINISHED")]
