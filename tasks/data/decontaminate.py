"""The decontaminate stage: drop (or flag) training documents that share word n-grams with eval sets.

Each eval file becomes a set of hashed word n-grams (NFKC, lowercased, punctuation stripped). A
training document sharing at least `min_overlap_ngrams` of them with an eval file is contaminated
by it. `contamination.json` says, per eval file, how many documents and n-grams overlapped, with
examples, so a contaminated benchmark is visible rather than silently cleaned.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section
from tasks.data.dedup import strip_punctuation
from tasks.data.documents import DOCUMENTS_FILE, REMOVED_FILE, ReasonLog, read_documents
from tasks.errors import InputError

CONTAMINATION_FILE = "contamination.json"
_NUM_EXAMPLES = 5


class DecontaminateConfig(Section):
    ngram_size: int = Field(13, ge=1)  # words; 13 follows GPT-3's decontamination
    min_overlap_ngrams: int = Field(1, ge=1)  # a doc sharing >= this many eval n-grams is contaminated
    action: Literal["remove", "flag"] = "remove"


def words(text: str) -> list[str]:
    text = unicodedata.normalize("NFKC", text).lower()
    # Punctuation becomes nothing, not a space, so "don't" and "dont" match.
    return strip_punctuation(text).split()


def _hash(gram: str) -> int:
    # A stable hash (Python's hash() is salted per process); 8 bytes keeps collisions negligible.
    return int.from_bytes(hashlib.blake2b(gram.encode("utf-8"), digest_size=8).digest(), "little")


def ngrams(tokens: list[str], size: int) -> dict[int, str]:
    """Hashed word n-grams of a token list, each with its text."""
    grams = (" ".join(tokens[i : i + size]) for i in range(len(tokens) - size + 1))
    return {_hash(gram): gram for gram in grams}


@dataclass
class _EvalIndex:
    """The n-grams of one eval file, and what the training data matched of them."""

    name: str
    path: Path
    hashes: set[int]
    num_eval_docs: int
    num_eval_docs_too_short: int  # shorter than one n-gram: cannot be detected
    matched: set[int] = field(default_factory=set)
    num_docs_contaminated: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "num_eval_docs": self.num_eval_docs,
            "num_eval_docs_too_short": self.num_eval_docs_too_short,
            "num_eval_ngrams": len(self.hashes),
            "num_docs_contaminated": self.num_docs_contaminated,
            "num_overlapping_ngrams": len(self.matched),
            "examples": self.examples,
        }


def _load_eval(path: Path, size: int) -> _EvalIndex:
    if not path.is_file():
        raise InputError(f"eval file {str(path)!r} does not exist; check the evaluate stage's suite paths")
    hashes: set[int] = set()
    num_docs = too_short = 0
    with open(path, encoding="utf-8") as handle:
        try:
            lines = list(enumerate(handle, 1))
        except UnicodeDecodeError as err:
            raise InputError(f"eval file {str(path)!r} is not UTF-8 ({err}); re-encode it") from err
    for line_no, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{line_no}: invalid JSON ({err}); fix or remove the line") from err
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path}:{line_no}: expected an object with a string field 'text'")
        num_docs += 1
        grams = ngrams(words(record["text"]), size)
        too_short += not grams
        hashes.update(grams)
    if num_docs == 0:
        raise InputError(f"eval file {str(path)!r} holds no records; point the suite at a non-empty file")
    return _EvalIndex(path.stem, path, hashes, num_docs, too_short)


def decontaminate_documents(
    cfg: DecontaminateConfig, input_file: Path, eval_files: list[Path], out_dir: Path
) -> dict:
    """Remove (or flag) training documents overlapping the eval files; write the contamination report."""
    indexes = [_load_eval(Path(path), cfg.ngram_size) for path in eval_files]
    by_name: dict[str, Path] = {}
    for index in indexes:
        if index.name in by_name:
            raise InputError(
                f"eval files {str(by_name[index.name])!r} and {str(index.path)!r} share the name "
                f"{index.name!r}; reports and removal reasons are keyed by file name: rename one"
            )
        by_name[index.name] = index.path
    counts = DocCounts()
    num_flagged = 0
    with (
        open(out_dir / DOCUMENTS_FILE, "w", encoding="utf-8") as out,
        ReasonLog(out_dir / REMOVED_FILE) as removed,
    ):
        for doc in read_documents(input_file):
            counts.num_in += 1
            doc_grams = ngrams(words(doc.text), cfg.ngram_size)
            overlaps: dict[str, int] = {}
            for index in indexes:
                shared = index.hashes.intersection(doc_grams)
                if len(shared) < cfg.min_overlap_ngrams:
                    continue
                overlaps[index.name] = len(shared)
                index.matched |= shared
                index.num_docs_contaminated += 1
                if len(index.examples) < _NUM_EXAMPLES:
                    index.examples.append({"doc_id": doc.id, "ngram": doc_grams[min(shared)]})
            if overlaps:
                doc.metadata["contamination"] = overlaps
            if overlaps and cfg.action == "remove":
                reason = f"contaminated:{next(iter(overlaps))}"  # the first eval file, in the given order
                removed.add(reason, asdict(doc))
                counts.removed[reason] += 1
                continue
            num_flagged += bool(overlaps)
            out.write(doc.to_json() + "\n")
            counts.num_kept += 1
    report = {
        "ngram_size": cfg.ngram_size,
        "min_overlap_ngrams": cfg.min_overlap_ngrams,
        "action": cfg.action,
        "eval_files": {index.name: index.report() for index in indexes},
    }
    (out_dir / CONTAMINATION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return {
        **counts.as_dict(),
        "num_flagged": num_flagged,
        "contamination": {
            index.name: {
                "num_docs_contaminated": index.num_docs_contaminated,
                "num_overlapping_ngrams": len(index.matched),
            }
            for index in indexes
        },
    }
