"""Kiln's own files found from any folder: `kiln:` names in configs and on the command line, the default
config of a folder without one, and every file the packaged default config names (sources, the quality
classifier, eval sets) read from a project folder that has none of them, with the keys Kiln's checkout
gives. The same from an installed wheel: tests/test_install.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.bundled import locate, packaged, packaged_name, shipped
from kiln.tasks.config import PACKAGED_DEFAULT, config_chain, default_config_path, load_config
from kiln.tasks.data.clean import CleanConfig
from kiln.tasks.data.collect import CollectConfig, collect_documents, source_paths
from kiln.tasks.data.quality_training import resolve_quality_model
from kiln.tasks.data.source_files import local_path, resolved
from kiln.tasks.errors import ConfigError
from kiln.tasks.fingerprint import DigestCache, fingerprint_paths
from kiln.tasks.graph import stage_keys
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.tracker import NullTracker

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """An empty folder outside Kiln's checkout, as the working directory."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_kiln_names_are_kilns_own_files_and_name_them_in_errors(elsewhere):
    assert packaged("kiln:configs/tiny.yaml") == shipped("configs") / "tiny.yaml"
    assert packaged_name(shipped("data") / "evals" / "heldout.jsonl") == "kiln:data/evals/heldout.jsonl"
    assert packaged_name(elsewhere) is None
    with pytest.raises(ConfigError, match=r"kiln:configs/tinny.yaml: Kiln ships no such file; kiln:configs/ holds "
                                          r"clusters, default.yaml, examples, models, project, research, tiny.yaml"):
        packaged("kiln:configs/tinny.yaml")
    with pytest.raises(ConfigError, match="Kiln's own files are under kiln:configs/, kiln:infra/, kiln:data/"):
        packaged("kiln:default.yaml")
    # a project's own file of a shipped name wins; a kiln: name never looks in the folder
    (elsewhere / "data" / "evals").mkdir(parents=True)
    (elsewhere / "data" / "evals" / "heldout.jsonl").write_text('{"text": "mine"}\n')
    assert locate("data/evals/heldout.jsonl") == Path("data/evals/heldout.jsonl")
    assert locate("kiln:data/evals/heldout.jsonl") == shipped("data") / "evals" / "heldout.jsonl"
    assert locate("data/evals/heldout_code.jsonl") == shipped("data") / "evals" / "heldout_code.jsonl"
    assert locate("data/evals/absent.jsonl") == Path("data/evals/absent.jsonl")  # the error names the config's path


def test_a_project_config_extends_kilns_default_by_its_kiln_name(elsewhere, capsys):
    (elsewhere / "kiln.yaml").write_text("extends: kiln:configs/tiny.yaml\nwork_dir: runs\n")
    assert default_config_path() == "kiln.yaml"
    cfg = load_config("kiln.yaml")
    assert cfg.work_dir == "runs" and cfg.model_dump(exclude={"work_dir"}) == load_config(
        str(REPO / "configs" / "tiny.yaml")).model_dump(exclude={"work_dir"})
    assert [name for name, _ in config_chain("kiln.yaml")] == ["kiln.yaml", "kiln:configs/tiny.yaml",
                                                               "kiln:configs/default.yaml"]
    # `kiln config` says which files it resolved, and where this installation keeps Kiln's
    assert main(["config"]) == 0
    head = capsys.readouterr().out.splitlines()[:3]
    assert head == ["# resolved from: kiln.yaml",
                    f"#          over: kiln:configs/tiny.yaml  ({shipped('configs') / 'tiny.yaml'})",
                    f"#          over: kiln:configs/default.yaml  ({shipped('configs') / 'default.yaml'})"]
    # an error in an inherited setting names Kiln's file by its kiln: name
    (elsewhere / "kiln.yaml").write_text("extends: kiln:configs/tiny.yaml\ncollect:\n  sources:\n"
                                         "    - {name: mine, path: data/mine.jsonl, format: jsonl, domain: news}\n")
    with pytest.raises(ConfigError, match=r"kiln:configs/default.yaml: clean.quality_training.positive_sources: "
                                          r"sources \['web-maint-guide-en'\]"):
        load_config("kiln.yaml")


def test_a_folder_without_a_config_runs_kilns_packaged_default(elsewhere, capsys):
    assert default_config_path() == PACKAGED_DEFAULT
    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# resolved from: {PACKAGED_DEFAULT}  (")
    # the keys of Kiln's own default, found here: the same config and the same bytes of data as in the checkout
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        in_checkout = stage_keys(load_config("configs/default.yaml"))
    assert stage_keys(load_config(PACKAGED_DEFAULT)) == in_checkout
    assert all(f"{stage}: {key}" in out for stage, key in in_checkout.items())


def test_sources_kiln_ships_are_read_from_a_folder_that_lacks_them(elsewhere, tmp_path):
    sample = shipped("data") / "sample"
    assert resolved("data/sample/prose/coreutils-man") == str(sample / "prose/coreutils-man")
    assert resolved("data/sample/prose/*/ls.1.txt") == str(sample / "prose/*/ls.1.txt")  # a glob keeps its pattern
    assert resolved("kiln:data/sample/code") == str(sample / "code")
    assert resolved("s3://bucket/data/sample/code") == "s3://bucket/data/sample/code"
    assert resolved("data/mine") == "data/mine" and local_path("data/mine") == Path("data/mine")
    (elsewhere / "data" / "sample" / "code").mkdir(parents=True)  # a folder of the project's own wins
    assert resolved("data/sample/code") == "data/sample/code"

    cfg = CollectConfig(sources=[
        {"name": "ls", "path": "data/sample/prose/*/ls.1.txt", "format": "txt", "domain": "prose", "licence": "GPL-3.0-or-later"},
        {"name": "colorlog", "path": "data/sample/code-tree/colorlog", "format": "code", "domain": "code"},
    ])
    stats = collect_documents(cfg, tmp_path / "collect")
    assert stats["num_kept"] == 5 and stats["removed"] == {"binary": 1, "licence_file": 1, "not_code": 1}
    assert [p.relative_to(sample) for p in source_paths(cfg)] == [Path("prose"), Path("code-tree/colorlog")]


def test_the_shipped_quality_classifier_sets_its_threshold_from_a_project_folder(elsewhere, tmp_path):
    """clean.quality_top_fraction scores the collected documents with clean.quality_model: the config's
    `data/models/quality_classifier.ftz`, which only Kiln has."""
    collected = tmp_path / "collect"
    collect_documents(CollectConfig(sources=[{"name": "man", "path": "data/sample/prose/coreutils-man", "format": "txt",
                                              "domain": "prose", "licence": "GPL-3.0-or-later"}],
                                    max_docs_per_source=20), collected)
    cfg = CleanConfig(quality_top_fraction=0.5, quality_model_domains=["prose"])
    assert cfg.quality_model == "data/models/quality_classifier.ftz" and not Path(cfg.quality_model).exists()
    (tmp_path / "clean").mkdir()
    stage = SubRuns(StageRecorder(NullTracker(), "clean-run", "clean", "clean-key"), tmp_path / "store")
    resolved_cfg = resolve_quality_model(cfg, collected, tmp_path / "clean", stage)
    assert resolved_cfg.quality_top_fraction is None and 0.0 < resolved_cfg.quality_threshold <= 1.0


def test_fingerprints_name_kilns_files_by_their_kiln_name_and_skip_bytecode_caches(elsewhere, tmp_path):
    """A key of Kiln's sample is the same wherever Kiln is installed; Python's bytecode caches (pip writes
    them into an installed wheel's sample code tree) change no key."""
    tree = shipped("data") / "sample" / "code-tree" / "colorlog"
    cache = DigestCache(tmp_path / "cache.sqlite")
    installed_elsewhere = tmp_path / "site-packages" / "tree"
    shutil.copytree(tree, installed_elsewhere)
    assert local_path("data/sample/code-tree/colorlog") == tree
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # the checkout names it by its relative path
        in_checkout = fingerprint_paths([local_path("data/sample/code-tree/colorlog")], cache)
    assert fingerprint_paths([tree], cache) == in_checkout != fingerprint_paths([installed_elsewhere], cache)
    before = fingerprint_paths([installed_elsewhere], cache)
    (installed_elsewhere / "colorlog" / "__pycache__").mkdir(exist_ok=True)
    (installed_elsewhere / "colorlog" / "__pycache__" / "wrappers.cpython-311.pyc").write_bytes(b"\0compiled")
    assert fingerprint_paths([installed_elsewhere], cache) == before
    (installed_elsewhere / "colorlog" / "wrappers.pyc").write_bytes(b"\0changed")  # a binary of the tree is data
    assert fingerprint_paths([installed_elsewhere], cache) != before
