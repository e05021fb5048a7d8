"""Tests for the clean stage's fastText quality classifier and PII redaction, with the shipped model.

Scores are the real predictions of `data/models/quality_classifier.ftz`: retraining it
(scripts/train_quality_classifier.py) may move them, and these numbers with it. The boilerplate
texts are shaped like the Python documentation's index and navigation pages, but are not copies
of the training pages.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.data.clean import CleanConfig, clean_documents, lid_model_path
from kiln.tasks.data.documents import Document, read_shards
from kiln.tasks.data.quality import SHIPPED_MODEL, QualityClassifierFilter
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.errors import ConfigError
from kiln.tasks.graph import stage_keys
from tests.fixtures.shards import raw, records, write_stage

from .test_clean import CODE, DE, EN

REPO = Path(__file__).resolve().parents[3]
INDEX_PAGE = (
    "Index – W\nwait() (in module os)\n(asyncio.Event method)\n(threading.Condition method)\nwalk() (in module os)\n"
    "warn() (in module warnings)\nwarning() (in module logging)\nWarning\nwarnings\nmodule\nweakref\nmodule"
)
NAVIGATION = (
    "Navigation\nindex\nmodules |\nnext |\nprevious |\nHome\n»\nDocumentation\n»\nTable of Contents\n"
    "Previous topic\nNext topic\nThis Page\nReport a Bug\nShow Source\nQuick search"
)
CONTACT = (
    EN + "\n\nReport bugs to Jane Doe <jane.doe@example.org> or to deity@lists.debian.org. The mirror at "
    "151.101.2.132 answers HTTPS; the router at 192.168.1.1 is private and stays as it is."
)
AUTHORED_CODE = "# Author: Guido van Rossum <guido@python.org>\n" + CODE


def _doc(doc_id: str, text: str, domain: str) -> Document:
    return Document(doc_id, text, source="test", domain=domain, licence="GPL-2.0", metadata={})


def _run(tmp_path: Path, corpus: list[Document], name: str, **overrides) -> tuple[dict, Path]:
    input_file = write_stage(tmp_path / f"{name}.input", corpus)
    out_dir = tmp_path / name
    out_dir.mkdir()
    cfg = CleanConfig(**{"quality_model": str(REPO / SHIPPED_MODEL)} | overrides)
    return clean_documents(cfg, input_file, out_dir), out_dir


def _removed(out: Path) -> dict[str, tuple[str, float]]:
    return {r["id"]: (r["reason"], r["metadata"]["quality_score"]) for r in records(out, "removed")}


def test_shipped_model_scores_prose_high_and_boilerplate_low() -> None:
    model = QualityClassifierFilter(str(REPO / SHIPPED_MODEL), threshold=0.1)
    # 4 significant digits: small probabilities keep their order (fastText's floor is 1e-05)
    assert [model.score(text) for text in (EN, DE, INDEX_PAGE, NAVIGATION)] == [1.0, 0.9933, 1e-05, 0.04713]
    assert (REPO / SHIPPED_MODEL).stat().st_size < 2 * 1024 * 1024


def test_classifier_removes_boilerplate_in_its_domains(tmp_path: Path) -> None:
    corpus = [
        _doc("prose", EN, "web"),
        _doc("index", INDEX_PAGE, "web"),
        _doc("navigation", NAVIGATION, "prose"),
        _doc("index-as-code", INDEX_PAGE, "code"),  # outside quality_model_domains: scored, not judged
    ]
    # No language ID or prose rules here (they drop such pages first): the classifier alone decides.
    rules_off = {"language_domains": [], "quality_domains": [], "c4": {"domains": []}, "fineweb": {"domains": []}}
    stats, out = _run(tmp_path, corpus, "classified", **rules_off)
    kept = list(read_shards(shard_paths(out)))
    assert [(d.id, d.metadata.get("quality_score")) for d in kept] == [("prose", 1.0), ("index-as-code", 1e-05)]
    assert _removed(out) == {
        "index": ("quality_classifier:low_quality", 1e-05),
        "navigation": ("quality_classifier:low_quality", 0.04713),
    }
    assert (stats["num_in"], stats["num_kept"], stats["num_removed"]) == (4, 2, 2)
    assert stats["removed"] == {"quality_classifier:low_quality": 2}
    assert stats["removed_by_filter"]["quality_classifier"] == 2

    stats, out = _run(tmp_path, corpus, "lenient", **rules_off, quality_threshold=0.04)
    assert _removed(out) == {"index": ("quality_classifier:low_quality", 1e-05)}
    stats, out = _run(tmp_path, corpus, "unclassified", **rules_off, quality_model=None)
    assert stats["num_kept"] == 4
    assert all("quality_score" not in d.metadata for d in read_shards(shard_paths(out)))


PII_CORPUS = [_doc("contact", CONTACT, "web"), _doc("code", AUTHORED_CODE, "code"), _doc("de", DE, "multilingual")]


def test_pii_is_redacted_and_counted_without_removing_documents(tmp_path: Path) -> None:
    stats, out = _run(tmp_path, PII_CORPUS, "pii")
    kept = {d.id: d for d in read_shards(shard_paths(out))}
    assert list(kept) == ["contact", "code", "de"]
    assert kept["contact"].text == EN + (
        "\n\nReport bugs to Jane Doe <email@example.com> or to email@example.com. The mirror at "
        "192.0.2.1 answers HTTPS; the router at 192.168.1.1 is private and stays as it is."
    )
    assert kept["code"].text == AUTHORED_CODE  # code is not in the default pii_domains
    assert kept["de"].text == DE
    assert (stats["num_in"], stats["num_kept"], stats["num_removed"], stats["num_quarantined"]) == (3, 3, 0, 0)
    assert stats["pii"] == {"num_docs_redacted": 1, "num_replacements": {"email": 2, "ip": 1, "card": 0, "phone": 0}}
    assert all("kiln_pii_replacements" not in d.metadata for d in kept.values())

    stats, out = _run(tmp_path, PII_CORPUS, "with-code", pii_domains=["web", "code"])
    assert [d.text for d in read_shards(shard_paths(out))][1] == (
        "# Author: Guido van Rossum <email@example.com>\n" + CODE
    )
    assert stats["pii"] == {"num_docs_redacted": 2, "num_replacements": {"email": 3, "ip": 1, "card": 0, "phone": 0}}

    stats, out = _run(tmp_path, PII_CORPUS, "verbatim", pii_redaction=False)
    assert [d.text for d in read_shards(shard_paths(out))] == [CONTACT, AUTHORED_CODE, DE]
    assert stats["pii"] == {"num_docs_redacted": 0, "num_replacements": {"email": 0, "ip": 0, "card": 0, "phone": 0}}
    assert CleanConfig(pii_redaction=False).identity() != CleanConfig().identity()


def test_pii_and_classifier_output_does_not_depend_on_num_workers(tmp_path: Path) -> None:
    corpus = [*PII_CORPUS, _doc("index", INDEX_PAGE, "web"), _doc("contact-2", CONTACT, "prose")]
    rules_off = {"language_domains": [], "quality_domains": [], "c4": {"domains": []}, "fineweb": {"domains": []}}
    stats1, out1 = _run(tmp_path, corpus, "w1", **rules_off, num_workers=1)
    stats2, out2 = _run(tmp_path, corpus, "w2", **rules_off, num_workers=2)
    assert {k: v for k, v in stats1.items() if k != "executor_cpu_s"} == {
        k: v for k, v in stats2.items() if k != "executor_cpu_s"}
    assert stats1["pii"] == {"num_docs_redacted": 2, "num_replacements": {"email": 4, "ip": 2, "card": 0, "phone": 0}}
    assert stats1["num_in"] == stats1["num_kept"] + stats1["num_removed"] + stats1["num_quarantined"] == 5
    assert _removed(out1) == {"index": ("quality_classifier:low_quality", 1e-05)}
    for kind in ("documents", "removed"):
        assert raw(out1, kind) == raw(out2, kind)


def test_bad_quality_model_settings_are_config_errors(tmp_path: Path) -> None:
    write_stage(tmp_path / "input", PII_CORPUS)
    missing = tmp_path / "nowhere.ftz"
    with pytest.raises(ConfigError, match=f"clean.quality_model: {missing} does not exist"):
        clean_documents(CleanConfig(quality_model=str(missing)), tmp_path / "input", tmp_path)
    with pytest.raises(ConfigError, match="clean.quality_model: .*lid.176.ftz has labels .* not '__label__hq'"):
        clean_documents(CleanConfig(quality_model=str(lid_model_path())), tmp_path / "input", tmp_path)
    with pytest.raises(ValueError, match="quality_threshold"):
        CleanConfig(quality_threshold=1.5)


def test_the_model_file_content_enters_the_clean_key(tmp_path: Path) -> None:
    model = tmp_path / "model.ftz"
    shutil.copy(REPO / SHIPPED_MODEL, model)
    before = stage_keys(load_config(REPO / "configs" / "tiny.yaml", [f"clean.quality_model={model}"]))
    with open(model, "ab") as handle:
        handle.write(b"\0")
    after = stage_keys(load_config(REPO / "configs" / "tiny.yaml", [f"clean.quality_model={model}"]))
    assert before["collect"] == after["collect"]
    assert before["clean"] != after["clean"]
    assert before["dedup"] != after["dedup"]
