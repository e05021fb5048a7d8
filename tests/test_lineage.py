"""`kiln lineage`: the chain of store entries behind an output, found by key, run id or path."""

import json
import shutil
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import KilnError
from kiln.tasks.lineage import as_json, continuation, lineage, locate, render_table
from kiln.tasks.runner import run_pipeline
from kiln.tasks.stage import Registry
from kiln.tasks.stages import collect as collect_stage
from kiln.tasks.stages.train import Branch, TrainConfig
from kiln.tasks.store import Store
from kiln.tasks.train.config import DataPhase, LongDocuments, RopeScaling
from tests.fixtures import toy_stage

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def built(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    registry = Registry([collect_stage.STAGE, toy_stage.STAGE])
    cfg = load_config("tests/fixtures/toy.yaml", [f"work_dir={tmp_path}"], registry=registry)
    return Store(cfg.store_root), run_pipeline(cfg, registry=registry)


def test_lineage_walks_from_any_reference_back_to_the_sources(built):
    store, (collect, toy) = built
    by_path = locate(store, str(Path(toy.path) / "long_ids.json"))
    assert by_path == locate(store, toy.key) == locate(store, f"toy-count/{toy.key}") == locate(store, toy.mlflow_run_id)
    links = lineage(store, *by_path)
    assert [(link.stage, link.key) for link in links] == [("collect", collect.key), ("toy-count", toy.key)]
    assert links[1].inputs == {"collect": collect.key} and links[1].config_sections == ["toy_count"]
    licences = json.loads((Path(collect.path) / "compliance.json").read_text())
    assert links[0].licences and set(links[0].licences) <= set(licences["allowed_licences"])
    assert sum(links[0].licences.values()) == store.manifest("collect", collect.key)["stats"]["num_kept"]
    table = render_table(links)
    assert collect.key in table and toy.key in table and "licences of the documents collect kept" in table
    assert [entry["key"] for entry in json.loads(as_json(links))] == [collect.key, toy.key]


def test_a_bad_reference_or_a_broken_chain_is_a_clear_error(built):
    store, (collect, toy) = built
    with pytest.raises(KilnError, match="names no committed entry"):
        locate(store, "feedfeedfeed")
    shutil.rmtree(collect.path)
    with pytest.raises(KilnError, match=f"collect/{collect.key} is not complete"):
        lineage(store, "toy-count", toy.key)


def test_an_adjustment_that_extends_the_context_says_so_in_its_lineage() -> None:
    train = TrainConfig(branch=Branch(prefix="af80929deb48", from_step=20), phases=[
        DataPhase(name="main", until_step=20),
        DataPhase(name="long", seq_len=256, rope_scaling=RopeScaling(kind="yarn", factor=4, original_max_seq_len=64),
                  long_documents=LongDocuments(min_tokens=256, upweight=4))])
    assert continuation("train", {"train": train.identity()}) == (
        "train af80929deb48 up to step 20, then schedule main (to step 20) -> long seq_len 256 rope_scaling yarn x4 "
        "long documents (>= 256 tokens) x4 to step plan")
