"""The decontaminate stage: drop (or flag) training documents that share word n-grams with eval sets.

Each eval set — a JSON-lines file, or an lm-eval task whose documents come through lm-eval's
`TaskManager` — becomes an index of hashed word n-grams (NFKC, lowercased, punctuation stripped)
that remembers which eval documents hold each one. A training document sharing at least
`min_overlap_ngrams` of them with an eval set is contaminated by it; n-grams that many training
documents hold (licence notices, page footers) are boilerplate, not leaked test data, and are
ignored, so a first pass counts each eval n-gram's training document frequency. The report works in both
directions: per benchmark, which training documents overlap (with examples), and which eval
documents any training document touches — the contamination rate the evaluate stage records beside
each task's score (`contamination_rates.json`, keyed by the evaluate stage's task names).
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section
from tasks.data.dedup import strip_punctuation
from tasks.data.documents import DOCUMENTS_FILE, REMOVED_FILE, ReasonLog, read_documents
from tasks.errors import InputError
from tasks.evals.evaluate import Contamination, require_hub
from tasks.evals.heldout_task import read_eval_records, task_name_for

CONTAMINATION_FILE = "contamination.json"
CONTAMINATION_REPORT = "contamination.md"
RATES_FILE = "contamination_rates.json"
_NUM_EXAMPLES = 5
_SNIPPET_CONTEXT = 12  # words either side of a matched n-gram in an example's snippet


class DecontaminateConfig(Section):
    ngram_size: int = Field(13, ge=1)  # words; 13 follows GPT-3's decontamination
    min_overlap_ngrams: int = Field(1, ge=1)  # a doc sharing >= this many eval n-grams is contaminated
    action: Literal["remove", "flag"] = "remove"
    # Eval n-grams held by more than this many training documents are boilerplate (licence
    # notices, man-page footers) and ignored, as in GPT-3's decontamination; None counts all.
    max_ngram_doc_frequency: int | None = Field(10, ge=1)


def words(text: str) -> list[str]:
    text = unicodedata.normalize("NFKC", text).lower()
    # Punctuation becomes nothing, not a space, so "don't" and "dont" match.
    return strip_punctuation(text).split()


def _hash(gram: str) -> int:
    # A stable hash (Python's hash() is salted per process); 8 bytes keeps collisions negligible.
    return int.from_bytes(hashlib.blake2b(gram.encode("utf-8"), digest_size=8).digest(), "little")


def ngram_positions(tokens: list[str], size: int) -> dict[int, int]:
    """Hashed word n-grams of a token list, each with the position of its first occurrence."""
    positions: dict[int, int] = {}
    for i in range(len(tokens) - size + 1):
        positions.setdefault(_hash(" ".join(tokens[i : i + size])), i)
    return positions


@dataclass
class EvalIndex:
    """The n-grams of one eval set, which eval documents hold them, and what training data matched."""

    name: str  # report key and removal reason (`contaminated:<name>`)
    task_name: str  # the evaluate stage's lm-eval task name, the key of its contamination rate
    source: str  # the eval file's path, or `lm-eval:<task>`
    doc_ids: list[str]
    holders: dict[int, list[int]]  # n-gram hash -> indices of the eval documents holding it
    num_eval_docs_too_short: int  # shorter than one n-gram: cannot be detected
    ignored: set[int] = field(default_factory=set)  # n-grams too common in the training data to count
    shared: set[int] = field(default_factory=set)  # n-grams any training document holds (not ignored)
    matched: set[int] = field(default_factory=set)  # n-grams held by contaminated training documents
    num_docs_contaminated: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)

    def contaminated_eval_docs(self) -> list[str]:
        """Eval documents sharing any n-gram with the training data, in eval order."""
        indices = {i for gram in self.shared for i in self.holders[gram]}
        return [self.doc_ids[i] for i in sorted(indices)]

    def contamination_rate(self) -> float:
        return len(self.contaminated_eval_docs()) / len(self.doc_ids)

    def report(self) -> dict[str, Any]:
        contaminated = self.contaminated_eval_docs()
        return {
            "source": self.source,
            "task_name": self.task_name,
            "num_eval_docs": len(self.doc_ids),
            "num_eval_docs_too_short": self.num_eval_docs_too_short,
            "num_eval_ngrams": len(self.holders),
            "num_ngrams_ignored_as_common": len(self.ignored),
            "num_eval_docs_contaminated": len(contaminated),
            "contamination_rate": len(contaminated) / len(self.doc_ids),
            "contaminated_eval_docs": contaminated,
            "num_docs_contaminated": self.num_docs_contaminated,
            "num_overlapping_ngrams": len(self.matched),
            "examples": self.examples,
        }


def _index(name: str, task: str, source: str, docs: Iterable[tuple[str, str]], size: int) -> EvalIndex:
    doc_ids: list[str] = []
    holders: dict[int, list[int]] = {}
    too_short = 0
    for i, (doc_id, text) in enumerate(docs):
        doc_ids.append(doc_id)
        grams = ngram_positions(words(text), size)
        too_short += not grams
        for gram in grams:
            holders.setdefault(gram, []).append(i)
    if not doc_ids:
        raise InputError(f"eval set {source!r} holds no documents; point the suite at a non-empty one")
    return EvalIndex(name, task, source, doc_ids, holders, too_short)


def _task_docs(names: Sequence[str], include_path: Path | None) -> dict[str, list[tuple[str, str]]]:
    """(id, text) of each evaluation document of each lm-eval task: its prompt and its answer."""
    from lm_eval.tasks import TaskManager  # lm-eval takes seconds to import; only task names need it

    path = str(include_path) if include_path else None
    if path is None:
        require_hub(names)  # before indexing lm-eval's tasks (seconds) to find out the data cannot come
    manager = TaskManager(include_path=path, include_defaults=False) if path else None
    if manager is None or any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=path)  # indexing every built-in task takes several seconds
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise InputError(f"decontaminate eval tasks {unknown} are not lm-eval tasks; see `lm_eval ls tasks`")
    docs: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        try:
            tasks = manager.load([name])["tasks"]
        except ConnectionError as err:  # huggingface_hub's OfflineModeIsEnabled is one
            raise InputError(
                f"lm-eval task {name!r}: its data could not be loaded ({err}). Built-in tasks download "
                "from the Hugging Face hub and need network access: run online, or give the eval set "
                "as a local JSON-lines file"
            ) from err
        docs[name] = [
            (f"{task_name}/{i}", _task_doc_text(task, doc))
            for task_name, task in sorted(tasks.items())
            for i, doc in enumerate(task.eval_docs)
        ]
    return docs


def _task_doc_text(task: Any, doc: dict) -> str:
    """What a model is shown and scored on: the prompt and the correct answer's text."""
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice" and isinstance(target, int):
        target = task.doc_to_choice(doc)[target]
    parts = [task.doc_to_text(doc), *(target if isinstance(target, list) else [target])]
    return " ".join(str(part) for part in parts)


def index_ngrams(
    eval_files: Sequence[Path], eval_tasks: Sequence[str], size: int, *, task_include_path: Path | None = None
) -> list[EvalIndex]:
    """One n-gram index per eval file (named by its stem) and per lm-eval task (named by the task).

    `task_include_path` is a folder of extra lm-eval task YAMLs (lm-eval's `include_path`).
    """
    indexes = [
        _index(Path(path).stem, task_name_for(Path(path)), str(path), read_eval_records(Path(path)), size)
        for path in eval_files
    ]
    for name, docs in _task_docs(eval_tasks, task_include_path).items() if eval_tasks else ():
        indexes.append(_index(name, name, f"lm-eval:{name}", docs, size))
    by_name: dict[str, str] = {}
    for index in indexes:
        if index.name in by_name:
            raise InputError(
                f"eval sets {by_name[index.name]!r} and {index.source!r} share the name {index.name!r}; "
                "reports and removal reasons are keyed by it: rename one"
            )
        by_name[index.name] = index.source
    return indexes


def decontaminate_documents(
    cfg: DecontaminateConfig,
    input_file: Path,
    eval_files: list[Path],
    out_dir: Path,
    *,
    eval_tasks: Sequence[str] = (),
    task_include_path: Path | None = None,
) -> dict:
    """Remove (or flag) training documents overlapping the eval sets; write the contamination reports."""
    indexes = index_ngrams(eval_files, eval_tasks, cfg.ngram_size, task_include_path=task_include_path)
    # Pass 1: which eval n-grams each training document holds, and in how many documents each occurs.
    matches: dict[int, list[dict[int, int]]] = {}  # doc number -> per index: n-gram -> position
    doc_frequency: dict[int, int] = {}
    for n, doc in enumerate(read_documents(input_file)):
        doc_grams = ngram_positions(words(doc.text), cfg.ngram_size)
        found = [{gram: doc_grams[gram] for gram in index.holders.keys() & doc_grams.keys()} for index in indexes]
        if any(found):
            matches[n] = found
            for gram in set().union(*found):
                doc_frequency[gram] = doc_frequency.get(gram, 0) + 1
    limit = cfg.max_ngram_doc_frequency
    common = {gram for gram, df in doc_frequency.items() if limit is not None and df > limit}
    for index in indexes:
        index.ignored = common & index.holders.keys()

    # Pass 2: decide and write, in input order.
    counts = DocCounts()
    num_flagged = 0
    with (
        open(out_dir / DOCUMENTS_FILE, "w", encoding="utf-8") as out,
        ReasonLog(out_dir / REMOVED_FILE) as removed,
    ):
        for n, doc in enumerate(read_documents(input_file)):
            counts.num_in += 1
            overlaps: dict[str, int] = {}
            for index, found in zip(indexes, matches.get(n, [{}] * len(indexes)), strict=True):
                shared = found.keys() - common
                index.shared |= shared
                if len(shared) < cfg.min_overlap_ngrams:
                    continue
                overlaps[index.name] = len(shared)
                index.matched |= shared
                index.num_docs_contaminated += 1
                if len(index.examples) < _NUM_EXAMPLES:
                    gram = min(shared)
                    index.examples.append(_example(doc.id, words(doc.text), found[gram], cfg.ngram_size))
            if overlaps:
                doc.metadata["contamination"] = overlaps
            if overlaps and cfg.action == "remove":
                reason = f"contaminated:{next(iter(overlaps))}"  # the first eval set, in the given order
                removed.add(reason, asdict(doc))
                counts.removed[reason] += 1
                continue
            num_flagged += bool(overlaps)
            out.write(doc.to_json() + "\n")
            counts.num_kept += 1
    report = {
        "ngram_size": cfg.ngram_size,
        "min_overlap_ngrams": cfg.min_overlap_ngrams,
        "max_ngram_doc_frequency": cfg.max_ngram_doc_frequency,
        "action": cfg.action,
        "benchmarks": {index.name: index.report() for index in indexes},
    }
    (out_dir / CONTAMINATION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / CONTAMINATION_REPORT).write_text(contamination_markdown(report), encoding="utf-8")
    rates = {index.task_name: index.contamination_rate() for index in indexes}
    (out_dir / RATES_FILE).write_text(json.dumps(rates, indent=2) + "\n", encoding="utf-8")
    return {
        **counts.as_dict(),
        "num_flagged": num_flagged,
        "contamination": {
            index.name: {
                "num_docs_contaminated": index.num_docs_contaminated,
                "num_overlapping_ngrams": len(index.matched),
                "contamination_rate": index.contamination_rate(),
            }
            for index in indexes
        },
    }


def _example(doc_id: str, tokens: list[str], start: int, size: int) -> dict[str, str]:
    """A matched n-gram and the normalised words around it in the training document."""
    lo, hi = max(0, start - _SNIPPET_CONTEXT), start + size + _SNIPPET_CONTEXT
    return {
        "doc_id": doc_id,
        "ngram": " ".join(tokens[start : start + size]),
        "snippet": ("… " if lo else "") + " ".join(tokens[lo:hi]) + (" …" if hi < len(tokens) else ""),
    }


def contamination_markdown(report: dict[str, Any]) -> str:
    """The contamination report as a Markdown table per benchmark, with its examples."""
    lines = [
        "# Contamination",
        "",
        f"{report['ngram_size']}-word n-grams; a training document sharing at least "
        f"{report['min_overlap_ngrams']} with a benchmark is contaminated "
        f"({ {'remove': 'removed', 'flag': 'flagged'}[report['action']] }). "
        "Contamination rate: eval documents sharing any n-gram with the training data / eval documents.",
        "",
        "| benchmark | eval docs | contaminated eval docs | rate | contaminated training docs | overlapping n-grams |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    benchmarks = report["benchmarks"]
    for name, b in benchmarks.items():
        lines.append(
            f"| {name} | {b['num_eval_docs']} | {b['num_eval_docs_contaminated']} | {b['contamination_rate']:.2%} "
            f"| {b['num_docs_contaminated']} | {b['num_overlapping_ngrams']} |"
        )
    for name, b in benchmarks.items():
        if not b["examples"]:
            continue
        lines += ["", f"## {name}", ""]
        lines += [f"- `{e['doc_id']}`: \"{e['ngram']}\" — {e['snippet']}" for e in b["examples"]]
    return "\n".join(lines) + "\n"


def read_contamination(out_dir: Path) -> Contamination:
    """What a decontaminate output found, keyed as the evaluate stage names its tasks: each eval file's
    contaminated documents (by its bits-per-byte task's name) and each lm-eval task's rate."""
    report = json.loads((out_dir / CONTAMINATION_FILE).read_text(encoding="utf-8"))
    rates = json.loads((out_dir / RATES_FILE).read_text(encoding="utf-8"))
    ids = {b["task_name"]: set(b["contaminated_eval_docs"]) for b in report["benchmarks"].values()
           if not b["source"].startswith("lm-eval:")}
    return Contamination(rates=rates, contaminated_ids=ids)
