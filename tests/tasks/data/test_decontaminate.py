"""Decontamination against eval files: which training documents overlap, by how much, and what happens to them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents, words
from tasks.data.documents import Document, write_documents
from tasks.errors import InputError

# Real text: paragraphs of the Apache License 2.0 (the eval passages) and of the GPL v3 preamble.
APACHE_DERIVATIVE = (
    '"Derivative Works" shall mean any work, whether in Source or Object form, that is based on (or '
    "derived from) the Work and for which the editorial revisions, annotations, elaborations, or other "
    "modifications represent, as a whole, an original work of authorship."
)
APACHE_CONTRIBUTION = (
    '"Contributor" shall mean Licensor and any individual or Legal Entity on behalf of whom a '
    "Contribution has been received by Licensor and subsequently incorporated within the Work."
)
GPL_FREEDOM = (
    "When we speak of free software, we are referring to freedom, not price. Our General Public Licenses "
    "are designed to make sure that you have the freedom to distribute copies of free software (and "
    "charge for them if you wish), that you receive source code or can get it if you want it, that you "
    "can change the software or use pieces of it in new free programs, and that you know you can do "
    "these things."
)
GPL_RIGHTS = (
    "To protect your rights, we need to prevent others from denying you these rights or asking you to "
    "surrender the rights. Therefore, you have certain responsibilities if you distribute copies of the "
    "software, or if you modify it: responsibilities to respect the freedom of others."
)
# The first 13 words of APACHE_DERIVATIVE (after normalisation) and the first 12.
THIRTEEN = '"Derivative Works" shall mean any work, whether in Source or Object form, that'
TWELVE = '"Derivative Works" shall mean any work, whether in Source or Object form,'


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _run(tmp_path: Path, docs: list[tuple[str, str]], name: str = "run", **cfg) -> tuple[dict, list, list, dict]:
    work = tmp_path / name
    out = work / "out"
    out.mkdir(parents=True)
    evals = _write_jsonl(work / "licence_qa.jsonl", [{"text": APACHE_DERIVATIVE}, {"text": APACHE_CONTRIBUTION}])
    input_file = work / "in.jsonl"
    write_documents(input_file, [Document(i, t, "prose", "prose", "GPL-3.0-or-later") for i, t in docs])
    stats = decontaminate_documents(DecontaminateConfig(**cfg), input_file, [evals], out)
    kept = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    removed_file = out / "removed.jsonl"
    removed = [json.loads(line) for line in removed_file.read_text().splitlines()] if removed_file.exists() else []
    report = json.loads((out / "contamination.json").read_text())
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"] == len(docs)
    assert stats["num_kept"] == len(kept) and stats["num_removed"] == len(removed)
    return stats, kept, removed, report


DOCS = [
    # An eval passage quoted (with case and punctuation changes) inside a longer training document.
    ("quoted", f"{GPL_FREEDOM} {APACHE_DERIVATIVE.upper().replace(',', '')} {GPL_RIGHTS}"),
    ("clean", GPL_FREEDOM),
    ("thirteen", f"{GPL_RIGHTS} {THIRTEEN}"),
    ("twelve", f"{GPL_RIGHTS} {TWELVE}"),
]


def test_n_gram_lengths_of_the_fixtures():
    assert len(words(THIRTEEN)) == 13 and len(words(TWELVE)) == 12
    assert len(words(APACHE_DERIVATIVE)) == 41


def test_documents_quoting_an_eval_passage_are_removed(tmp_path):
    stats, kept, removed, report = _run(tmp_path, DOCS)
    assert [d["id"] for d in kept] == ["clean", "twelve"]
    assert [(r["id"], r["reason"], r["metadata"]["contamination"]) for r in removed] == [
        ("quoted", "contaminated:licence_qa", {"licence_qa": 41 - 13 + 1}),
        ("thirteen", "contaminated:licence_qa", {"licence_qa": 1}),
    ]
    assert stats["removed"] == {"contaminated:licence_qa": 2}
    assert stats["contamination"] == {"licence_qa": {"num_docs_contaminated": 2, "num_overlapping_ngrams": 29}}
    qa = report["eval_files"]["licence_qa"]
    assert (qa["num_eval_docs"], qa["num_eval_docs_too_short"]) == (2, 0)
    assert qa["num_eval_ngrams"] == (41 - 12) + (len(words(APACHE_CONTRIBUTION)) - 12)
    assert qa["examples"][1] == {
        "doc_id": "thirteen",
        "ngram": "derivative works shall mean any work whether in source or object form that",
    }


def test_flag_mode_keeps_contaminated_documents_and_marks_them(tmp_path):
    stats, kept, removed, _ = _run(tmp_path, DOCS, action="flag")
    assert removed == []
    assert [(d["id"], d["metadata"].get("contamination")) for d in kept] == [
        ("quoted", {"licence_qa": 29}),
        ("clean", None),
        ("thirteen", {"licence_qa": 1}),
        ("twelve", None),
    ]
    assert stats["num_flagged"] == 2 and stats["num_kept"] == 4


def test_ngram_size_and_minimum_overlap_are_respected(tmp_path):
    stats, kept, _, _ = _run(tmp_path, DOCS, name="twelve", ngram_size=12)
    assert [d["id"] for d in kept] == ["clean"]  # a 12-word quote now matches
    stats, kept, _, _ = _run(tmp_path, DOCS, name="min2", min_overlap_ngrams=2)
    assert [d["id"] for d in kept] == ["clean", "thirteen", "twelve"]  # one shared 13-gram is not enough


def test_eval_texts_shorter_than_one_ngram_are_reported(tmp_path):
    evals = _write_jsonl(tmp_path / "short.jsonl", [{"text": TWELVE}, {"text": APACHE_CONTRIBUTION}])
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document("d", GPL_RIGHTS, "s", "prose", "MIT")])
    (tmp_path / "out").mkdir()
    decontaminate_documents(DecontaminateConfig(), input_file, [evals], tmp_path / "out")
    report = json.loads((tmp_path / "out" / "contamination.json").read_text())
    assert report["eval_files"]["short"]["num_eval_docs_too_short"] == 1


def test_missing_or_bad_eval_files_are_input_errors_naming_them(tmp_path):
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document("d", GPL_RIGHTS, "s", "prose", "MIT")])
    (tmp_path / "out").mkdir()
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(InputError, match="nowhere.jsonl"):
        decontaminate_documents(DecontaminateConfig(), input_file, [missing], tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": GPL_RIGHTS}) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"bad.jsonl:2: invalid JSON"):
        decontaminate_documents(DecontaminateConfig(), input_file, [bad], tmp_path / "out")
    no_text = _write_jsonl(tmp_path / "no_text.jsonl", [{"question": GPL_RIGHTS}])
    with pytest.raises(InputError, match=r"no_text.jsonl:1: expected an object with a string field 'text'"):
        decontaminate_documents(DecontaminateConfig(), input_file, [no_text], tmp_path / "out")
