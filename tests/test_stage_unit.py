"""The stage unit: a new stage is one declaration plus a registry entry; the plain-Python runner gives
any caller (a notebook, a Slurm job) the same manifest and commit; a damaged output is redone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.errors import ConfigError
from tasks.graph import stage_keys
from tasks.runner import run_pipeline, run_stage
from tasks.stage import Registry
from tasks.stages import REGISTRY
from tasks.stages import collect as collect_stage
from tasks.store import MANIFEST_FILE, Store, file_sha256
from tests.fixtures import toy_stage

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

    documents = Path(first[0].path) / "documents.jsonl"
    whole = documents.read_bytes()
    documents.write_bytes(whole[:-10])  # truncated
    assert "documents.jsonl has" in store.problems("collect", first[0].key)[0]
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
