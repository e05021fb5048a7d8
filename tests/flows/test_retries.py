"""A retried pipeline flow run (what the UI's Retry and flow `retries=` do) reuses what succeeded,
redoes what failed, and stays one MLflow pipeline run tagged with the Prefect flow-run id: named and
configured as its latest attempt ran, with each attempt's stage runs named and tagged by attempt."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

import kiln.flows.pipeline
import kiln.flows.stages
import kiln.tasks.stages
from kiln.tasks.config import load_config
from kiln.tasks.configbase import Section
from kiln.tasks.errors import ConfigError, KilnError
from kiln.tasks.stage import Registry, Stage, StageContext
from kiln.tasks.stages import collect

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
    for module in (kiln.tasks.stages, kiln.flows.pipeline, kiln.flows.stages):
        monkeypatch.setattr(module, "REGISTRY", registry)
    overrides = [f"work_dir={tmp_path}"]

    outcomes = kiln.flows.pipeline.pipeline.with_options(retries=1)(TOY, overrides)

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


class PickyConfig(Section):
    ready: bool = False


def picky_stage(config_file: Path, fixed: str) -> Stage:
    """A stage that refuses its config until `ready` is set; its first attempt also writes the fix into
    the config file, as a user does between a failed run and the Retry."""

    def body(ctx: StageContext) -> dict:
        if not ctx.cfg.picky.ready:
            config_file.write_text(fixed)
            raise ConfigError("picky.ready is false: set it to true")
        return {"ready": True}

    return Stage(name="picky", description="needs ready", body=body, inputs=("collect",), config=PickyConfig)


def test_a_retry_after_a_config_fix_renames_the_parent_and_names_each_attempts_stage_runs(
        prefect_api, in_repo, tmp_path, monkeypatch):
    config = tmp_path / "mine.yaml"
    broken = f"extends: {Path(TOY).resolve()}\npicky: {{ready: false}}\n"
    config.write_text(broken)
    registry = Registry([collect.STAGE, picky_stage(config, broken.replace("false", "true"))])
    for module in (kiln.tasks.stages, kiln.flows.pipeline, kiln.flows.stages):
        monkeypatch.setattr(module, "REGISTRY", registry)
    overrides = [f"work_dir={tmp_path / 'work'}"]
    first = load_config(str(config), overrides, registry)

    outcomes = kiln.flows.pipeline.pipeline.with_options(retries=1)(str(config), overrides)

    assert [(o["stage"], o["status"]) for o in outcomes] == [("collect", "cached"), ("picky", "ran")]
    fixed = load_config(str(config), overrides, registry)
    client = MlflowClient(fixed.tracking_uri)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    [parent] = client.search_runs([experiment], filter_string="tags.`kiln.stage` = 'pipeline'")
    fixed_hash = config_hash(fixed)
    assert fixed_hash != config_hash(first)
    assert parent.info.run_name == f"pipeline/mine/{fixed_hash}" and parent.data.tags["kiln.config_hash"] == fixed_hash
    artifacts = {path: client.download_artifacts(parent.info.run_id, path, str(tmp_path / f"artifacts-{i}"))
                 for i, path in enumerate(("resolved_config.json", "attempts/1/resolved_config.json",
                                           "attempts/2/resolved_config.json"))}
    ready = {path: json.loads(Path(local).read_text())["picky"]["ready"] for path, local in artifacts.items()}
    assert ready == {"resolved_config.json": True, "attempts/1/resolved_config.json": False,
                     "attempts/2/resolved_config.json": True}
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted((c.info.run_name, c.data.tags["kiln.attempt"], c.data.tags["kiln.status"]) for c in children) == [
        ("collect", "1", "ran"), ("collect (attempt 2)", "2", "cached"),
        ("picky", "1", "failed"), ("picky (attempt 2)", "2", "ran")]


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True, default=str).encode()).hexdigest()[:12]


def test_a_stage_the_runner_committed_outside_prefect_shows_cached_and_a_failed_runs_result_stays_in_its_work_dir(
        prefect_api, in_repo, tmp_path, monkeypatch):
    """collect committed by the plain runner (a notebook, a Slurm job, or a run whose process died
    between the store's commit and Prefect's record): Prefect shows its reuse as Cached. The flow run's
    persisted exception goes to the run's work dir, not to this process's PREFECT_HOME."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from kiln.flows.environment import results_dir
    from kiln.tasks.runner import run_stage

    registry = Registry([collect.STAGE, flaky_stage(failures=1)])
    for module in (kiln.tasks.stages, kiln.flows.pipeline, kiln.flows.stages):
        monkeypatch.setattr(module, "REGISTRY", registry)
    overrides = [f"work_dir={tmp_path / 'work'}"]
    cfg = load_config(TOY, overrides, registry)
    assert run_stage("collect", cfg, registry=registry).status == "ran"
    default_storage = Path(get_current_settings().results.local_storage_path)
    before = set(default_storage.glob("*"))

    state = kiln.flows.pipeline.pipeline(TOY, overrides, return_state=True)

    assert state.is_failed()
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[state.state_details.flow_run_id])))
    assert sorted((t.name.rsplit("-", 1)[0], t.state_name) for t in task_runs) == [("collect", "Cached"),
                                                                                   ("flaky", "Failed")]
    assert [p for p in results_dir(cfg).iterdir()]  # the flow run's failure, persisted beside its store
    assert set(default_storage.glob("*")) == before
