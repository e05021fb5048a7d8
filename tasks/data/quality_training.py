"""A quality classifier trained from your references, DCLM style: fastText, reference text against the corpus.

DCLM's filter is a fastText classifier whose positives are text one wants more of (instruction
data, ELI5 answers) and whose negatives are a sample of the raw pool; documents are then kept by
score. Here the positives are the configured `references` (any collect source entry: a jsonl of
reference prose, a parquet table, a dataset...) plus the documents of any collect sources named
in `positive_sources`; the negatives are the collected documents of `negative_domains` from every
other source. Every document becomes windows of `window_words` words (one fastText example
each, so that long and short documents both count), the larger class is subsampled to the
smaller, and a split of whole documents, chosen by a hash of their id, is held out: precision and
recall at P(hq) = 0.5 and ROC-AUC over those documents are the model's report card.

Training is reproducible: the same data and config give the same model, bit for bit, so a fresh
run's quality scores (and everything ranked by them: dedup's survivors, the anneal's selections)
repeat. fastText 0.9 initialises only a tenth of its input matrix per thread and leaves the rest
as allocated, so with fewer than 10 threads that rest is whatever the heap held ("Encountered
NaN"), and with 10 threads training is Hogwild, whose updates race. `_train_in_fresh_process`
trains with one thread in a child process where glibc fills every new allocation with zeros
(`mallopt(M_PERTURB, 0xff)`; fresh pages are zero anyway): the rest starts at zero, whatever the
heap held before, so training is deterministic.
Without glibc it falls back to 10 threads (not reproducible; `dim` must then be a multiple of 10),
and the report says so. The model is a sub-run of the clean stage that trains it, and only that:
kept in the store itself, named by its key (`quality_model/<key>`, `kiln.tasks.ledger.keyed_subrun`:
the key hashes the training config, the references' content and the collect output it read), so
every clean run whose settings differ elsewhere reuses it: a manifest with provenance, an MLflow
child run of the clean run that trained it (a cached child run for each one that reuses it),
locked, committed and resumed as every stage and sub-run is (`kiln.tasks.ledger.SubRuns`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from kiln.tasks.bundled import locate
from kiln.tasks.configbase import Section, names_field
from kiln.tasks.data.collect import read_candidates
from kiln.tasks.data.compliance import SourceReport
from kiln.tasks.data.documents import read_shards
from kiln.tasks.data.quality import HQ_LABEL, fasttext_text
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.data.source_files import local_path
from kiln.tasks.data.sources import Source, remote_identity
from kiln.tasks.fingerprint import fingerprint_paths
from kiln.tasks.ledger import SubRun, SubRuns, keyed_subrun

STORE_STAGE = "quality_model"  # the store folder of trained models
MODEL_FILE = "quality_classifier.bin"
REPORT_FILE = "quality_classifier.json"
FORMAT_VERSION = 2  # 2: trained reproducibly (one thread on zero-filled memory), not Hogwild
_LQ_LABEL = "__label__lq"
_M_PERTURB = -6  # glibc's mallopt parameter: new allocations are filled with the complement of its byte
_SCORE_BATCH = 1024  # documents scored per fastText call


class QualityTraining(Section):
    """Train the clean stage's quality classifier instead of using the shipped one."""

    # Positives: high-quality reference text, as collect source entries (format, path, domain...);
    # their licences are not judged: reference text trains the classifier, never the model.
    references: list[Source] = Field(min_length=1)
    positive_sources: list[str] = names_field("source", [])  # collect sources whose documents are positives too
    negative_domains: list[str] = names_field("domain", ["web", "prose"])  # negatives: collected documents of these domains
    held_out_fraction: float = Field(0.2, gt=0.0, lt=0.5)
    window_words: int = Field(64, ge=8)
    min_window_words: int = Field(16, ge=1)  # a document's shorter tail is dropped below this
    epoch: int = Field(25, ge=1)
    lr: float = Field(0.5, gt=0.0)
    word_ngrams: int = Field(2, ge=1)
    dim: int = Field(10, ge=10)  # a multiple of 10 (the 10-thread fallback's NaN bug otherwise)
    bucket: int = Field(100_000, ge=1_000)  # hashed word-bigram rows
    seed: int = 0  # subsampling, shuffling and fastText's initialisation

    def identity(self) -> dict[str, Any]:
        """Remote references' content enters the key as their listing (ETags, version ids), local ones' as
        their files' (`reference_paths`)."""
        remote = remote_identity(self.references)
        return super().identity() | ({"remote_references_sha256": remote} if remote else {})

    @field_validator("references")
    @classmethod
    def _references_take_no_domain_field(cls, references: list[Source]) -> list[Source]:
        named = [source.name for source in references if getattr(source, "domain_field", None) is not None]
        if named:
            raise ValueError(f"references {named} set domain_field: reference text is positive whatever its domain, "
                             "so no record's domain is read; drop domain_field and domains")
        return references

    @field_validator("dim")
    @classmethod
    def _dim_multiple_of_ten(cls, value: int) -> int:
        if value % 10:
            raise ValueError(f"dim={value}: fastText 0.9 leaves part of its matrix uninitialised (NaN) unless dim "
                             "is a multiple of 10; use 10, 20, ...")
        return value


def reference_paths(cfg: QualityTraining | None) -> list[Path]:
    """The references' local files, whose content enters the clean stage's key."""

    if cfg is None:
        return []
    return [path for path in (local_path(source.path) for source in cfg.references) if path is not None]


def _reference_texts(cfg: QualityTraining) -> Iterator[tuple[str, str]]:
    """(id, text) of every readable reference document; unreadable records are skipped (counted)."""
    for source in cfg.references:
        report = SourceReport(source.name, source.path, source.format, source.domain, source.licence)
        for candidate in read_candidates(source, 10_000_000, report):
            if candidate.problem is None and candidate.skip is None and candidate.text and candidate.text.strip():
                position = candidate.location.get("line", candidate.location.get("row", candidate.location.get("offset")))
                yield f"{source.name}/{candidate.id or candidate.location['path']}:{position}", candidate.text


def labelled_documents(cfg: QualityTraining, collected: Path) -> Iterator[tuple[str, str, str]]:
    """(label, doc id, text): references and documents of `positive_sources` as hq, the rest of
    `negative_domains` as lq; `collected` is a collect output's folder, read shard by shard."""
    yield from (("hq", doc_id, text) for doc_id, text in _reference_texts(cfg))
    for doc in read_shards(shard_paths(collected)):
        if doc.source in cfg.positive_sources:
            yield "hq", doc.id, doc.text
        elif doc.domain in cfg.negative_domains:
            yield "lq", doc.id, doc.text


def held_out(doc_id: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") < fraction * 2**64


def _windows(text: str, size: int, min_words: int) -> list[str]:
    words = fasttext_text(text).lower().split()
    return [" ".join(words[i:i + size]) for i in range(0, len(words), size) if len(words[i:i + size]) >= min_words]


class _Lines:
    """One label's fastText lines in a file, each found again by its offset: the windows of a whole
    corpus need not fit in memory to be subsampled and shuffled."""

    def __init__(self, path: Path):
        self.handle = open(path, "w+b")
        self.offsets = array("q")

    def add(self, line: str) -> None:
        self.offsets.append(self.handle.tell())
        self.handle.write(line.encode("utf-8") + b"\n")

    def __len__(self) -> int:
        return len(self.offsets)

    def line(self, i: int) -> bytes:
        self.handle.seek(self.offsets[i])
        return self.handle.readline()


def _training_file(cfg: QualityTraining, lines: dict[str, _Lines], path: Path) -> dict[str, int]:
    """Write the fastText training file: the larger class subsampled to the size of the smaller (a
    seeded sample), shuffled. `random.sample` and `shuffle` pick by position alone, so drawing
    positions gives the lines drawing the lines themselves would."""
    rng = random.Random(cfg.seed)
    size = min(len(label_lines) for label_lines in lines.values())
    picks = [(label, i) for label in ("hq", "lq") for i in rng.sample(range(len(lines[label])), size)]
    rng.shuffle(picks)
    with open(path, "wb") as out:
        out.writelines(lines[label].line(i) for label, i in picks)
    return {f"num_{label}_windows": len(label_lines) for label, label_lines in lines.items()} | {
        "num_windows_per_class": size}


def train_quality_model(cfg: QualityTraining, collected: Path, out_dir: Path) -> dict[str, Any]:
    """Train on the documents of `collected` (a collect output's folder) and the references; write
    the model and its held-out report into `out_dir`; returns the report. The documents are streamed
    twice (windows for training, then the held-out documents to score): nothing holds the corpus."""
    import fasttext
    from sklearn.metrics import precision_score, recall_score, roc_auc_score

    counts = Counter({f"num_{split}_{label}_docs": 0 for split in ("train", "held_out") for label in ("hq", "lq")})
    with tempfile.TemporaryDirectory() as tmp:
        lines = {label: _Lines(Path(tmp) / f"{label}.lines") for label in ("hq", "lq")}
        for label, doc_id, text in labelled_documents(cfg, collected):
            split = "held_out" if held_out(doc_id, cfg.held_out_fraction) else "train"
            counts[f"num_{split}_{label}_docs"] += 1
            if split == "train":
                for window in _windows(text, cfg.window_words, cfg.min_window_words):
                    lines[label].add(f"__label__{label} {window}")
        missing = [name for name, n in counts.items() if name.startswith("num_train") and n == 0]
        if missing:
            raise ValueError(f"clean.quality_training: no training documents for {', '.join(missing)}: add "
                             "references, or collect sources in clean.quality_training.negative_domains")
        started = time.perf_counter()
        train_file = Path(tmp) / "train.txt"
        window_counts = _training_file(cfg, lines, train_file)
        for label_lines in lines.values():
            label_lines.handle.close()
        fit = dict(lr=cfg.lr, epoch=cfg.epoch, wordNgrams=cfg.word_ngrams, dim=cfg.dim, bucket=cfg.bucket,
                   minCount=1, seed=cfg.seed, verbose=0)
        # Not quantised: on two cores quantising (with its retraining) costs ~6x the training itself,
        # and the unquantised model is (bucket + vocabulary) x dim floats: 4 MB at the defaults.
        # forkserver, not fork: the caller (a flow runner) may hold threads, and locks, that fork copies.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
            threads = pool.submit(_train_in_fresh_process, str(train_file), str(out_dir / MODEL_FILE), fit).result()
    model = fasttext.load_model(str(out_dir / MODEL_FILE))
    train_s = time.perf_counter() - started

    truth, scores = [], []
    for label, doc_id, text in labelled_documents(cfg, collected):
        if held_out(doc_id, cfg.held_out_fraction):
            truth.append(int(label == "hq"))
            scores.append(score_texts(model, [text])[0])
    predicted = [int(score >= 0.5) for score in scores]
    both = 0 < sum(truth) < len(truth)
    report = {
        **counts, **window_counts, "train_s": round(train_s, 2), "threads": threads, "reproducible": threads == 1,
        "held_out": {
            "precision": precision_score(truth, predicted, zero_division=0.0) if truth else None,
            "recall": recall_score(truth, predicted, zero_division=0.0) if truth else None,
            "roc_auc": roc_auc_score(truth, scores) if both else None,  # undefined with one class held out
        },
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def _train_in_fresh_process(train_file: str, model_file: str, fit: dict[str, Any]) -> int:
    """Train and save a fastText model in this (new) process; returns the threads it used. With
    glibc, every allocation from here on is zero-filled (and freed memory overwritten), so the part
    of the input matrix that one thread leaves uninitialised is zero; without it, 10 threads."""
    import ctypes

    import fasttext

    try:
        threads = 1 if ctypes.CDLL(None).mallopt(_M_PERTURB, 0xFF) == 1 else 10
    except AttributeError:  # no mallopt: not glibc
        threads = 10
    fasttext.train_supervised(train_file, thread=threads, **fit).save_model(model_file)
    return threads


def score_texts(model: Any, texts: list[str]) -> list[float]:
    """P(hq) of each text (a list to `predict`: numpy 2 refuses the single-string form)."""
    labels, probs = model.predict([fasttext_text(text) for text in texts], k=-1)
    return [float(dict(zip(ls, ps)).get(HQ_LABEL, 0.0)) for ls, ps in zip(labels, probs)]


def model_subrun(cfg: QualityTraining, collect_key: str) -> SubRun:
    """The model as a sub-run stored at `quality_model/<key>`: its key hashes the training settings, the
    references' content and the collect output (not the clean stage's key)."""
    identity = {"training": cfg.identity(), "references_sha256": fingerprint_paths(reference_paths(cfg))}
    return keyed_subrun(STORE_STAGE, identity, {"collect": collect_key},
                        params=cfg.model_dump(mode="json", exclude={"references"}), version=FORMAT_VERSION)


def trained_model(cfg: QualityTraining, collect_dir: Path, subruns: SubRuns) -> tuple[Path, dict[str, Any]]:
    """The model for `cfg` and the collect output at `collect_dir` (its folder name is its key): the
    sub-run's, trained now unless one is stored for its key."""
    outcome = subruns.run(model_subrun(cfg, collect_dir.name),
                          lambda folder, _: train_quality_model(cfg, collect_dir, folder))
    return outcome.path / MODEL_FILE, {"key": outcome.key, "model": str(outcome.path / MODEL_FILE), **outcome.stats}


def top_fraction_threshold(model_path: Path, collected: Path, domains: list[str], fraction: float) -> float:
    """The score that keeps the best `fraction` of the documents of `domains` in `collected` (a collect
    output's folder; ties kept): DCLM keeps a top share of its pool rather than a fixed probability."""
    import fasttext

    model = fasttext.load_model(str(model_path))
    scores: list[float] = []
    batch: list[str] = []
    for doc in read_shards(shard_paths(collected)):
        if doc.domain in domains and doc.text.strip():
            batch.append(doc.text)
        if len(batch) == _SCORE_BATCH:
            scores += score_texts(model, batch)
            batch = []
    scores += score_texts(model, batch) if batch else []
    if not scores:
        return 0.0
    scores = sorted((round(s, 4) for s in scores), reverse=True)
    return scores[max(0, min(len(scores), round(fraction * len(scores))) - 1)]


def resolve_quality_model(cfg: Any, collected: Path, out_dir: Path, subruns: SubRuns) -> Any:
    """The clean config to run on `collected` (a collect output's folder, named by its key): with the model
    trained from `cfg.quality_training` (the clean stage's sub-run in the store, `subruns`: trained
    now unless stored for its key) and the score threshold that keeps `cfg.quality_top_fraction` of the
    input; the classifier's report goes to `out_dir/quality_classifier.json`."""
    update: dict[str, Any] = {}
    report: dict[str, Any] = {}
    if cfg.quality_training is not None:
        model, report = trained_model(cfg.quality_training, collected, subruns)
        update = {"quality_model": str(model), "quality_training": None}
    model_path = update.get("quality_model", cfg.quality_model)
    if model_path is not None and cfg.quality_top_fraction is not None:
        update["quality_threshold"] = top_fraction_threshold(locate(model_path), collected, cfg.quality_model_domains,
                                                             cfg.quality_top_fraction)
        update["quality_top_fraction"] = None  # resolved: a second call changes nothing
    if update:
        report |= {"model": str(model_path), "threshold": update.get("quality_threshold", cfg.quality_threshold),
                   "top_fraction": cfg.quality_top_fraction, "domains": cfg.quality_model_domains}
        (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return cfg.model_copy(update=update) if update else cfg


def classifier_metrics(report_file: Path) -> dict[str, float]:
    """The numbers of a classifier report worth a metric: held-out scores, counts, threshold."""
    if not report_file.is_file():
        return {}
    report = json.loads(report_file.read_text())
    flat = {f"quality_classifier.held_out.{k}": v for k, v in report.get("held_out", {}).items() if v is not None}
    flat |= {f"quality_classifier.{k}": v for k, v in report.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return flat
