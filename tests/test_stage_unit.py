"""The stage unit: a new stage is one declaration plus a registry entry; the plain-Python runner gives
any caller (a notebook, a Slurm job) the same manifest and commit; a damaged output is redone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.graph import stage_keys
from kiln.tasks.runner import run_pipeline, run_stage
from kiln.tasks.stage import Registry
from kiln.tasks.stages import REGISTRY
from kiln.tasks.stages import collect as collect_stage
from kiln.tasks.store import MANIFEST_FILE, Store, file_sha256
from tests.fixtures import busy_stage, toy_stage

REPO = Path(__file__).resolve().parents[1]
TOY = "tests/fixtures/toy.yaml"  # only the sections of collect and the toy stage


@pytest.fixture
def toy_registry(monkeypatch) -> Registry:
    monkeypatch.chdir(REPO)
    return Registry([collect_stage.STAGE, toy_stage.STAGE])


def test_a_new_stage_is_one_declaration_with_its_own_config_key_and_run(toy_registry, tmp_path):
    overrides = [f"work_dir={tmp_path}"]
    cfg = load_config(TOY, [*overrides, "toy_count.min_chars=2000"], registry=toy_registry)
    assert cfg.toy_count.min_chars == 2000  # the stage's section joined the config tree
    with pytest.raises(ConfigError, match="toy_count.min_char: unknown key"):
        load_config(TOY, ["toy_count.min_char=5"], registry=toy_registry)

    outcomes = run_pipeline(cfg, registry=toy_registry)  # no Prefect, no MLflow: the no-op tracker
    assert [(o.stage, o.status) for o in outcomes] == [("collect", "ran"), ("toy-count", "ran")]
    store = Store(cfg.store_root)
    manifest = store.manifest("toy-count", outcomes[1].key)
    long_ids = json.loads((Path(outcomes[1].path) / "long_ids.json").read_text())
    assert manifest["stats"]["num_long"] == len(long_ids) == outcomes[1].headline["long"]
    assert 0 < len(long_ids) < manifest["stats"]["num_in"]
    assert manifest["inputs"] == {"collect": outcomes[0].key}
    assert manifest["files"]["long_ids.json"]["sha256"] == file_sha256(Path(outcomes[1].path) / "long_ids.json")

    # Its setting moves its key only; a rerun reuses both.
    other = load_config(TOY, [*overrides, "toy_count.min_chars=10"], registry=toy_registry)
    keys, other_keys = stage_keys(cfg, toy_registry), stage_keys(other, toy_registry)
    assert keys["collect"] == other_keys["collect"] and keys["toy-count"] != other_keys["toy-count"]
    assert [o.status for o in run_pipeline(cfg, registry=toy_registry)] == ["cached", "cached"]


def test_a_damaged_output_is_redone_with_a_warning(toy_registry, tmp_path, caplog):
    cfg = load_config(TOY, [f"work_dir={tmp_path}"], registry=toy_registry)
    first = run_pipeline(cfg, registry=toy_registry)
    store = Store(cfg.store_root)
    ids = Path(first[1].path) / "long_ids.json"
    expected = ids.read_bytes()
    ids.unlink()
    assert store.problems("toy-count", first[1].key) == ["long_ids.json is missing"]
    with caplog.at_level(logging.WARNING):
        again = run_pipeline(cfg, registry=toy_registry)
    assert [o.status for o in again] == ["cached", "ran"]
    assert "toy-count" in caplog.text and "long_ids.json is missing" in caplog.text
    assert ids.read_bytes() == expected

    documents = Path(first[0].path) / "documents" / "00000.jsonl.zst"
    whole = documents.read_bytes()
    documents.write_bytes(whole[:-10])  # truncated
    assert "documents/00000.jsonl.zst has" in store.problems("collect", first[0].key)[0]
    # collect is redone, to the same bytes; toy-count's key (config and input keys) still holds
    assert [o.status for o in run_pipeline(cfg, registry=toy_registry)] == ["ran", "cached"]
    assert documents.read_bytes() == whole
    assert store.is_complete("collect", first[0].key) and (Path(first[0].path) / MANIFEST_FILE).is_file()


def test_a_stage_whose_inputs_are_missing_says_what_to_run_first(toy_registry, tmp_path):
    cfg = load_config(TOY, [f"work_dir={tmp_path}"], registry=toy_registry)
    with pytest.raises(Exception, match="stage toy-count needs collect first"):
        run_stage("toy-count", cfg, registry=toy_registry)


def test_the_registry_knows_every_stage_and_refuses_disorder():
    assert REGISTRY.pipeline()[0] == "collect" and "dedup-batch" not in REGISTRY.pipeline()
    assert "dedup-batch" in REGISTRY.names()
    with pytest.raises(ValueError, match="register those stages before it"):
        Registry([toy_stage.STAGE])
    with pytest.raises(ValueError, match="registered twice"):
        Registry([collect_stage.STAGE, collect_stage.STAGE])


def test_where_a_stage_ran_is_in_its_manifest_cost_and_mlflow_tags(toy_registry, tmp_path):
    """A stage body reports a training run and a sub-run's launch (as tasks.stages._training does): the
    manifest's `launch` says where each ran, a cluster job's workers' CPU joins the stage's cost, and
    the stage's and sub-run's MLflow runs are tagged with launcher, job ids and nodes."""
    from dataclasses import replace

    from mlflow.tracking import MlflowClient

    from kiln.tasks.launch.cluster import launch_record
    from kiln.tasks.ledger import SubRun
    from kiln.tasks.tracking import MlflowTracker

    job = launch_record("slurm", "kiln-toy-count-abc", [
        {"attempt": 1, "job_id": "41", "nodes": ["n1"], "failed": "Slurm job 41 ended FAILED", "failed_hosts": ["n1"]},
        {"attempt": 2, "job_id": "42", "nodes": ["n2"], "excluded": ["n1"], "time_to_resume_s": 6.5}], 12.5)

    def body(ctx):
        count_stats = toy_stage.count_long_documents(ctx)
        ctx.recorder.launched(job)
        ctx.recorder.subruns(ctx.out_dir).run(SubRun("branch", "b1", {}), lambda folder, recorder: (
            recorder.launched(launch_record("torchrun", "kiln-toy-count-abc-b1", [
                {"attempt": 1, "job_id": None, "nodes": ["here"]}], 3.0)), {})[1])
        return count_stats

    registry = Registry([collect_stage.STAGE, replace(toy_stage.STAGE, body=body)])
    cfg = load_config(TOY, [f"work_dir={tmp_path}"], registry=registry)
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "kiln", tmp_path / "artifacts")
    run_stage("collect", cfg, registry=registry, tracker=tracker)
    outcome = run_stage("toy-count", cfg, registry=registry, tracker=tracker)
    manifest = Store(cfg.store_root).manifest("toy-count", outcome.key)
    assert manifest["launch"]["launcher"] == "local" and manifest["launch"]["executor"] == "local"
    runs = manifest["launch"]["runs"]
    assert set(runs) == {"toy-count", "branch/b1"} and runs["toy-count"] == job
    assert (runs["branch/b1"]["launcher"], runs["branch/b1"]["job_name"]) == ("torchrun", "kiln-toy-count-abc-b1")
    # the Slurm job's workers are no children of this process: their 12.5 s join its own CPU time;
    # torchrun's are (already counted by getrusage)
    assert manifest["cost"]["jobs_cpu_s"] == 12.5 and manifest["cost"]["cpu_s"] > 12.5
    tags = MlflowClient(tracker.uri).get_run(outcome.mlflow_run_id).data.tags
    assert (tags["kiln.launcher"], tags["kiln.job_ids"], tags["kiln.nodes"]) == ("slurm,torchrun", "41,42", "here,n1,n2")
    assert tags["kiln.attempts"] == "3"


def test_a_training_job_is_named_after_its_stage_key_and_sub_run(tmp_path):
    from kiln.tasks.ledger import StageRecorder
    from kiln.tasks.settings import KilnConfig
    from kiln.tasks.stage import StageContext
    from kiln.tasks.stages._training import job_name
    from kiln.tasks.tracker import NullTracker

    stage = StageRecorder(NullTracker(), "run", "anneal-ablation", "0123456789abcdef0123")
    branch = StageRecorder(NullTracker(), "child", "anneal-ablation", "0123456789abcdef0123", parent=stage,
                           name="branches/From_Step_20")

    def name(recorder: StageRecorder) -> str:
        return job_name(StageContext(KilnConfig(), tmp_path, {}, Store(tmp_path), recorder))

    assert name(stage) == "kiln-anneal-ablation-0123456789ab"
    assert name(branch) == "kiln-anneal-ablation-0123456789ab-from-step-20"  # a Kubernetes Job name too


def test_a_stages_cpu_seconds_include_its_worker_processes(tmp_path):
    """Two ranks burn CPU in datatrove's local worker processes (forked from its forkserver, not children
    this process reaps): the stage's cpu_s counts them."""
    registry = Registry([busy_stage.STAGE])
    (tmp_path / "run.yaml").write_text(f"work_dir: {tmp_path}\n")
    cfg = load_config(tmp_path / "run.yaml", registry=registry)
    outcome = run_stage("burn", cfg, registry=registry)
    manifest = Store(cfg.store_root).manifest("burn", outcome.key)
    assert manifest["stats"]["worker_cpu_s"] >= 1.0 and manifest["stats"]["executor_cpu_s"] == 0.0
    assert manifest["cost"]["cpu_s"] >= manifest["stats"]["worker_cpu_s"]


def test_a_run_without_sources_is_refused_with_the_way_to_start(tmp_path):
    """No config and no sources (the sections' defaults): collect says how to start, it does not
    "complete" with 0 documents (issue 37)."""
    from kiln.tasks.config import load_config
    from kiln.tasks.errors import ConfigError
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.runner import run_stage
    from kiln.tasks.store import Store

    cfg = load_config(None, [f"work_dir={tmp_path}"])
    assert cfg.collect.sources == []
    with pytest.raises(ConfigError, match=r"nothing to collect.*`kiln init DIR`"):
        run_stage("collect", cfg)
    assert not Store(cfg.store_root).is_complete("collect", stage_keys(cfg)["collect"])
