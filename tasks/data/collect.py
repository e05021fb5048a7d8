"""The collect stage: read local sources (jsonl, txt, html trees) into Kiln documents.

Every input record ends up in exactly one place: `documents.jsonl` (kept), `removed.jsonl`
(licence not allowed, or unknown) or `quarantine.jsonl` (unreadable or unusable input, with the
file and line at fault); no input, however broken, raises (`tasks.data.readers`). Licences are
normalised to SPDX expressions and judged by `tasks.data.licences`; a compliance report per
source records which licences were seen, as written and normalised, and whether each is allowed.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section
from tasks.data.compliance import SourceReport, compliance_markdown, compliance_report
from tasks.data.documents import DOCUMENTS_FILE, QUARANTINE_FILE, REMOVED_FILE, Document, ReasonLog
from tasks.data.licences import LicencePolicy, LicenceVerdict, normalise
from tasks.data.readers import READERS, Candidate
from tasks.errors import ConfigError, InputError

DEFAULT_GLOBS = {"jsonl": "**/*.jsonl", "txt": "**/*.txt", "html": "**/*.html"}

# SPDX ids ("public-domain" reads as LicenseRef-public-domain) of licences that allow training and redistribution of derived text.
OPEN_LICENCES = [
    "MIT", "MIT-0", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "Zlib", "Unlicense",
    "PSF-2.0", "MPL-2.0", "EPL-2.0",
    "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-only", "GPL-3.0-or-later",
    "LGPL-2.1-only", "LGPL-2.1-or-later", "LGPL-3.0-only", "LGPL-3.0-or-later",
    "AGPL-3.0-only", "AGPL-3.0-or-later",
    "CC-BY-3.0", "CC-BY-4.0", "CC-BY-SA-3.0", "CC-BY-SA-4.0", "CC0-1.0",
    "ODC-By-1.0", "ODbL-1.0", "PDDL-1.0", "public-domain",
]  # fmt: skip


class SourceConfig(Section):
    """One local source: a file or a folder of files of one format, all of one domain."""

    name: str
    path: str
    format: Literal["jsonl", "txt", "html"]
    domain: str
    # An SPDX expression. None: every jsonl record must carry its own "licence" (or "license");
    # a record's own licence wins over this.
    licence: str | None = None
    glob: str | None = None


class CollectConfig(Section):
    sources: list[SourceConfig] = []
    allowed_licences: list[str] = OPEN_LICENCES
    # Keep only the first N documents of each source (files in sorted order): for tiny runs.
    max_docs_per_source: int | None = Field(None, ge=1)
    min_chars: int = Field(1, ge=0)
    # The largest input record, in bytes: a jsonl line, or a whole txt/html file. Larger ones are
    # quarantined as `too_large` without being read into memory (a corrupt file with no newline,
    # a dump of a binary); 10 MB is far above any real document, far below the memory of a worker.
    max_doc_bytes: int = Field(10_000_000, ge=1)


def source_paths(cfg: CollectConfig) -> list[Path]:
    """The input paths, for the stage key (their content is fingerprinted, not just their names)."""
    return [Path(source.path) for source in cfg.sources]


def _check_config(cfg: CollectConfig) -> LicencePolicy:
    """Fail before writing anything if a source cannot be read as configured; the licence policy."""
    try:
        policy = LicencePolicy(cfg.allowed_licences)
    except ValueError as err:
        raise ConfigError(f"collect.allowed_licences: {err}") from None
    seen: dict[str, int] = {}
    for i, source in enumerate(cfg.sources):
        if source.name in seen:
            raise ConfigError(
                f"collect.sources[{i}].name: source name {source.name!r} is already used by "
                f"collect.sources[{seen[source.name]}]; give every source a unique name"
            )
        seen[source.name] = i
        if source.licence is None and source.format != "jsonl":
            raise ConfigError(
                f"collect.sources[{i}].licence: source {source.name!r} is {source.format}, whose "
                "files carry no licence; set the licence of the source (an SPDX id)"
            )
        if source.licence is not None and normalise(source.licence) is None:
            raise ConfigError(
                f"collect.sources[{i}].licence: {source.licence!r} is no SPDX licence expression; use SPDX "
                "ids (https://spdx.org/licenses/, or LicenseRef-...) joined by AND, OR, WITH"
            )
        if not Path(source.path).exists():
            raise InputError(
                f"source {source.name!r}: path {source.path!r} does not exist (relative to "
                f"{Path.cwd()}); fix collect.sources[{i}].path"
            )
    return policy


def _files(source: SourceConfig) -> list[tuple[Path, str]]:
    """(file, path relative to the source) pairs in sorted order."""
    root = Path(source.path)
    if root.is_file():
        return [(root, root.name)]
    pattern = source.glob or DEFAULT_GLOBS[source.format]
    files = [(p, p.relative_to(root).as_posix()) for p in root.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda pair: pair[1])


_MAX_REASON_LICENCE_CHARS = 100  # a licence as written, in a reason (a stats key); in full in removed.jsonl


def collect_documents(cfg: CollectConfig, out_dir: Path) -> dict:
    """Read every source into `out_dir/documents.jsonl` and write the compliance report."""
    policy = _check_config(cfg)
    counts = DocCounts()
    reports = []
    seen_ids: set[str] = set()
    by_domain: Counter[str] = Counter()
    num_repaired = 0
    with (
        open(out_dir / DOCUMENTS_FILE, "w", encoding="utf-8") as kept,
        ReasonLog(out_dir / REMOVED_FILE) as removed,
        ReasonLog(out_dir / QUARANTINE_FILE) as quarantine,
    ):
        for source in cfg.sources:
            report = SourceReport(source.name, source.path, source.format, source.domain, source.licence)
            reports.append(report)
            files = _files(source)
            report.num_files = len(files)
            for file, rel in files:
                if report.capped:
                    break
                for candidate in READERS[source.format](file, rel, cfg.max_doc_bytes):
                    if cfg.max_docs_per_source is not None and report.num_kept >= cfg.max_docs_per_source:
                        report.capped = True
                        break
                    counts.num_in += 1
                    num_repaired += candidate.num_repaired > 0
                    reason, doc, verdict = _judge(candidate, source, cfg.min_chars, policy, seen_ids)
                    log_record = {"source": source.name, **candidate.location}
                    if verdict is not None:
                        report.saw(verdict)
                    if reason is None:
                        assert doc is not None
                        seen_ids.add(doc.id)
                        kept.write(doc.to_json() + "\n")
                        counts.num_kept += 1
                        report.num_kept += 1
                        report.num_chars += len(doc.text)
                        by_domain[source.domain] += 1
                    elif doc is not None:  # readable, but its licence is not allowed (or not known)
                        removed.add(reason, {**log_record, "document": json.loads(doc.to_json())})
                        counts.removed[reason] += 1
                        report.removed[reason] += 1
                    else:
                        extra = {key: value for key, value in (("detail", candidate.detail), ("raw", candidate.raw),
                                                               ("raw_prefix", candidate.raw_prefix)) if value}
                        quarantine.add(reason, {**log_record, **extra})
                        counts.quarantined[reason] += 1
                        report.quarantined[reason] += 1
    compliance = compliance_report(reports, policy.allowed)
    (out_dir / "compliance.json").write_text(json.dumps(compliance, indent=2) + "\n", encoding="utf-8")
    (out_dir / "compliance.md").write_text(compliance_markdown(compliance), encoding="utf-8")
    return {
        **counts.as_dict(),
        "num_repaired": num_repaired,  # inputs whose lone surrogates became U+FFFD (tasks.data.untrusted)
        "by_source": {r.name: r.num_kept for r in reports},
        "by_domain": dict(sorted(by_domain.items())),
        "num_chars": sum(r.num_chars for r in reports),
    }


def _judge(
    candidate: Candidate, source: SourceConfig, min_chars: int, policy: LicencePolicy, seen_ids: set[str]
) -> tuple[str | None, Document | None, LicenceVerdict | None]:
    """(None, doc, verdict) to keep; (reason, doc, verdict) to remove; (reason, None, None) to quarantine."""
    if candidate.problem is not None:
        return candidate.problem, None, None
    assert candidate.text is not None
    written = candidate.licence or source.licence
    if written is None:
        return "missing_licence", None, None
    if len(candidate.text.strip()) < min_chars:
        return "empty_text", None, None
    if candidate.id is not None:
        doc_id = f"{source.name}/{candidate.id}"
    else:
        doc_id = f"{source.name}/{candidate.location['path']}:{candidate.location['line']}"
    if doc_id in seen_ids:
        candidate.detail = f"id {doc_id!r} was already used by an earlier record"
        return "duplicate_id", None, None
    verdict = policy.judge(written)
    metadata = candidate.metadata
    if verdict.label != written:  # provenance: the licence as the input wrote it
        metadata = {**metadata, "licence_as_written": written}
    doc = Document(doc_id, candidate.text, source.name, source.domain, verdict.label, metadata)
    if verdict.status == "unknown":
        shown = written if len(written) <= _MAX_REASON_LICENCE_CHARS else written[:_MAX_REASON_LICENCE_CHARS] + "…"
        return f"licence_unknown:{shown}", doc, verdict
    if verdict.status == "not_allowed":
        return f"licence_not_allowed:{verdict.label}", doc, verdict
    return None, doc, verdict
