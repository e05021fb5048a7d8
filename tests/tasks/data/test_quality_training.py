"""The reference-trained quality classifier: trained reliably, held out, a sub-run of clean cached in the store by
its key (a manifest, an MLflow child run), applied to every document."""

from __future__ import annotations

import json
import random
from pathlib import Path

import fasttext
import pytest
from pydantic import ValidationError

from kiln.tasks.data.clean import CleanConfig, clean_documents
from kiln.tasks.data.collect import CollectConfig, collect_documents
from kiln.tasks.data.documents import read_shards
from kiln.tasks.data.quality import HQ_LABEL
from kiln.tasks.data.quality_training import (
    MODEL_FILE,
    REPORT_FILE,
    STORE_STAGE,
    QualityTraining,
    _Lines,
    _training_file,
    classifier_metrics,
    model_subrun,
    resolve_quality_model,
    score_texts,
    trained_model,
)
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.data.sources import SourceConfig
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker
from tests.fixtures.shards import records

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data/sample"
REFERENCES = [{"name": "python-reference", "path": str(SAMPLE / "references"), "format": "jsonl", "domain": "reference"}]


def subruns(root: Path, tracker=None) -> SubRuns:
    """The clean stage's sub-runs in the store at `root`."""
    return SubRuns(StageRecorder(tracker or NullTracker(), "clean-run", "clean", "clean-key"), root)


def model_key(cfg: QualityTraining, collect_key: str) -> str:
    return model_subrun(cfg, collect_key).name


class RecordingTracker(NullTracker):
    def __init__(self) -> None:
        self.runs: list[dict] = []

    def start_run(self, name, *, parent_id=None, tags=None, params=None) -> str:
        self.runs.append({"name": name, "parent": parent_id, "tags": dict(tags or {})})
        return f"run-{len(self.runs)}"


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> Path:
    """Real bundled documents: Python doc pages, man pages and code, as the collect stage writes them."""
    out = tmp_path_factory.mktemp("collect-abc123")
    sources = [
        SourceConfig(name="python-docs", path=str(SAMPLE / "web/python-docs-en"), format="html", domain="web", licence="PSF-2.0"),
        SourceConfig(name="maint-guide", path=str(SAMPLE / "web/maint-guide-en"), format="html", domain="web",
                     licence="GPL-2.0-or-later"),
        SourceConfig(name="coreutils", path=str(SAMPLE / "prose/coreutils-man"), format="txt", domain="prose",
                     licence="GPL-3.0-or-later"),
        SourceConfig(name="code", path=str(SAMPLE / "code"), format="jsonl", domain="code"),
    ]
    collect_documents(CollectConfig(sources=sources, max_docs_per_source=40), out)
    return out


def test_trains_reliably_and_reports_held_out_precision_recall_and_roc_auc(collected, tmp_path):
    cfg = QualityTraining(references=REFERENCES, positive_sources=["maint-guide"])
    model, report = trained_model(cfg, collected, subruns(tmp_path / "store"))
    held_out = report["held_out"]
    assert report["num_train_hq_docs"] > 0 and report["num_held_out_lq_docs"] > 0
    assert held_out["roc_auc"] > 0.8 and 0.0 < held_out["recall"] <= 1.0 and 0.0 < held_out["precision"] <= 1.0
    loaded = fasttext.load_model(str(model))
    assert HQ_LABEL in loaded.get_labels() and loaded.get_dimension() == 10
    assert classifier_metrics(model.parent / REPORT_FILE)["quality_classifier.held_out.roc_auc"] == held_out["roc_auc"]


def test_training_twice_gives_the_same_model_bit_for_bit(collected, tmp_path):
    """Hogwild training (fastText's 10 threads) differed on every fresh run, and so did the scores of
    every run and all that depends on them; two stores must now hold the same bytes."""
    cfg = QualityTraining(references=REFERENCES, epoch=5)
    first, report = trained_model(cfg, collected, subruns(tmp_path / "a"))
    second, _ = trained_model(cfg, collected, subruns(tmp_path / "b"))
    assert report["threads"] == 1 and report["reproducible"] is True
    assert first.read_bytes() == second.read_bytes()


def test_a_model_is_a_sub_run_trained_once_per_key(collected, tmp_path):
    store, tracker = Store(tmp_path / "store"), RecordingTracker()
    cfg = QualityTraining(references=REFERENCES, epoch=5)
    first, _ = trained_model(cfg, collected, subruns(store.root, tracker))
    manifest = store.manifest(STORE_STAGE, model_key(cfg, collected.name))
    assert (manifest["subrun"], manifest["inputs"], manifest["mlflow_run_id"]) == (
        f"quality_model/{model_key(cfg, collected.name)}", {"collect": collected.name}, "run-1")
    assert manifest["provenance"]["code"]["git_sha"] and manifest["stats"]["reproducible"] is True
    assert manifest["key"] == model_key(cfg, collected.name)  # named by its key, in the ledger's one scheme
    again, _ = trained_model(cfg, collected, subruns(store.root, tracker))
    assert again == first and store.manifest(STORE_STAGE, model_key(cfg, collected.name))["created_at"] == manifest["created_at"]
    # each clean run that needs it has a child run: the one that trained it, then one that reused it
    assert [(r["parent"], r["tags"]["kiln.status"]) for r in tracker.runs] == [("clean-run", "ran"), ("clean-run", "cached")]
    assert tracker.runs[1]["tags"]["kiln.source_run_id"] == "run-1"
    assert model_key(cfg.model_copy(update={"epoch": 6}), collected.name) != model_key(cfg, collected.name)
    assert model_key(cfg, "other-collect-key") != model_key(cfg, collected.name)


def test_clean_scores_every_document_and_keeps_the_top_fraction(collected, tmp_path):
    cfg = CleanConfig(quality_training=QualityTraining(references=REFERENCES), quality_top_fraction=0.5,
                      quality_model_domains=["web"], languages=["en"], pii_redaction=False)
    with pytest.raises(ValueError, match="resolve_quality_model first"):  # the model is trained one way: a sub-run
        clean_documents(cfg, collected, tmp_path)
    out = tmp_path / "clean"
    out.mkdir()
    resolved = resolve_quality_model(cfg, collected, out, subruns(tmp_path / "store"))
    stats = clean_documents(resolved, collected, out)
    kept = records(out)
    assert all("quality_score" in d["metadata"] for d in kept) and {d["domain"] for d in kept} >= {"code", "web"}
    report = json.loads((out / REPORT_FILE).read_text())
    model_file = tmp_path / "store" / STORE_STAGE / report["key"] / MODEL_FILE
    assert report["model"] == resolved.quality_model == str(model_file) and report["top_fraction"] == 0.5
    web_scores = [d["metadata"]["quality_score"] for d in kept if d["domain"] == "web"]
    assert min(web_scores) >= report["threshold"]
    # The threshold keeps the top half of the input's web documents (ties kept) and cuts the rest. Those
    # below it may all fall to earlier filters (language, Gopher) first, so how many the classifier
    # itself removes depends on the corpus, not on the fraction alone.
    model = fasttext.load_model(str(model_file))
    web = [d.text for d in read_shards(shard_paths(collected)) if d.domain == "web" and d.text.strip()]
    scores = [round(score, 4) for score in score_texts(model, web)]
    assert round(0.5 * len(scores)) <= sum(score >= report["threshold"] for score in scores) < len(scores)
    assert stats["removed_by_filter"].get("quality_classifier", 0) <= len(scores) - round(0.5 * len(scores))


def test_training_lines_are_drawn_from_disk_as_from_a_list(tmp_path):
    """The windows stay on disk; drawing positions with the seeded RNG picks the lines drawing from lists
    (the form before the corpus was streamed) picked, in the same order."""
    cfg = QualityTraining(references=REFERENCES, seed=7)
    texts = {"hq": [f"hq line {i}" for i in range(37)], "lq": [f"lq line {i} é" for i in range(90)]}
    lines = {label: _Lines(tmp_path / label) for label in texts}
    for label, label_lines in texts.items():
        for line in label_lines:
            lines[label].add(line)
    counts = _training_file(cfg, lines, tmp_path / "train.txt")
    rng = random.Random(7)
    expected = [line for label in ("hq", "lq") for line in rng.sample(texts[label], 37)]
    rng.shuffle(expected)
    assert (tmp_path / "train.txt").read_text(encoding="utf-8") == "".join(f"{line}\n" for line in expected)
    assert counts == {"num_hq_windows": 37, "num_lq_windows": 90, "num_windows_per_class": 37}


def test_training_settings_are_checked():
    with pytest.raises(ValidationError, match="multiple of 10"):
        QualityTraining(references=REFERENCES, dim=16)
    with pytest.raises(ValidationError, match="references"):
        QualityTraining(references=[])
    with pytest.raises(ValidationError, match=r"references \['python-reference'\] set domain_field"):
        QualityTraining(references=[{**REFERENCES[0], "domain_field": "domain", "domains": ["prose"]}])
