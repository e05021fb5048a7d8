"""The collect stage: read local sources (jsonl, txt, html trees) into Kiln documents.

Every input record ends up in exactly one place: `documents.jsonl` (kept), `removed.jsonl`
(licence not allowed) or `quarantine.jsonl` (unreadable or unusable input, with the file and
line at fault). A compliance report per source records which licences were seen and allowed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lxml.html
import trafilatura
from lxml.etree import ParserError
from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section
from tasks.data.documents import DOCUMENTS_FILE, QUARANTINE_FILE, REMOVED_FILE, Document, ReasonLog
from tasks.errors import ConfigError, InputError

DEFAULT_GLOBS = {"jsonl": "**/*.jsonl", "txt": "**/*.txt", "html": "**/*.html"}

# SPDX ids (plus "public-domain") of licences that allow training and redistribution of derived text.
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
    # None: every jsonl record must carry its own "licence"; a record's own licence wins over this.
    licence: str | None = None
    glob: str | None = None


class CollectConfig(Section):
    sources: list[SourceConfig] = []
    allowed_licences: list[str] = OPEN_LICENCES
    # Keep only the first N documents of each source (files in sorted order): for tiny runs.
    max_docs_per_source: int | None = Field(None, ge=1)
    min_chars: int = Field(1, ge=0)


def source_paths(cfg: CollectConfig) -> list[Path]:
    """The input paths, for the stage key (their content is fingerprinted, not just their names)."""
    return [Path(source.path) for source in cfg.sources]


@dataclass
class _SourceReport:
    """What one source contributed, for the compliance report."""

    name: str
    path: str
    format: str
    domain: str
    declared_licence: str | None
    num_files: int = 0
    num_kept: int = 0
    num_chars: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    quarantined: Counter[str] = field(default_factory=Counter)
    licences: Counter[str] = field(default_factory=Counter)
    capped: bool = False


@dataclass
class _Raw:
    """One candidate document as read from a file, before licence and length checks."""

    location: dict[str, Any]  # path (and line) of the input, carried into every log record
    id: str | None = None
    text: str | None = None
    licence: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # quarantine reason
    detail: str = ""
    raw: str | None = None  # the unparsed input, kept in quarantine so nothing is lost


def _check_sources(cfg: CollectConfig) -> None:
    """Fail before writing anything if a source cannot be read as configured."""
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
        if not Path(source.path).exists():
            raise InputError(
                f"source {source.name!r}: path {source.path!r} does not exist (relative to "
                f"{Path.cwd()}); fix collect.sources[{i}].path"
            )


def _files(source: SourceConfig) -> list[tuple[Path, str]]:
    """(file, path relative to the source) pairs in sorted order."""
    root = Path(source.path)
    if root.is_file():
        return [(root, root.name)]
    pattern = source.glob or DEFAULT_GLOBS[source.format]
    files = [(p, p.relative_to(root).as_posix()) for p in root.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda pair: pair[1])


def _read_jsonl(file: Path, rel: str) -> Iterator[_Raw]:
    with open(file, "rb") as handle:
        for line_no, raw_line in enumerate(handle, 1):
            location = {"path": rel, "line": line_no}
            if not raw_line.strip():
                continue
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                yield _Raw(location, problem="non_utf8", detail=str(err),
                           raw=raw_line.decode("utf-8", errors="backslashreplace"))  # fmt: skip
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield _Raw(location, problem="invalid_json", detail=str(err), raw=line)
                continue
            yield _from_record(record, location, line)


def _from_record(record: Any, location: dict[str, Any], line: str) -> _Raw:
    if not isinstance(record, dict):
        return _Raw(location, problem="not_an_object", raw=line)
    text = record.get("text")
    if not isinstance(text, str):
        return _Raw(location, problem="missing_text", detail="no string field 'text'", raw=line)
    record_id = record.get("id")
    if record_id is not None and (isinstance(record_id, bool) or not isinstance(record_id, (str, int))):
        return _Raw(location, problem="invalid_id", detail="'id' must be a string or integer", raw=line)
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        return _Raw(location, problem="invalid_metadata", detail="'metadata' must be an object", raw=line)
    licence = record.get("licence")
    return _Raw(
        location,
        id=None if record_id is None else str(record_id),
        text=text,
        licence=licence if isinstance(licence, str) and licence.strip() else None,
        metadata={**metadata, **location},
    )


def _read_text_file(file: Path, rel: str) -> tuple[str | None, _Raw | None]:
    """The file's text, or a quarantine record if it is not UTF-8."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, _Raw({"path": rel}, problem="non_utf8", detail=str(err))


def _read_txt(file: Path, rel: str) -> Iterator[_Raw]:
    text, bad = _read_text_file(file, rel)
    yield bad or _Raw({"path": rel}, id=rel, text=text, metadata={"path": rel})


def _read_html(file: Path, rel: str) -> Iterator[_Raw]:
    html, bad = _read_text_file(file, rel)
    if bad is not None:
        yield bad
        return
    text, metadata = extract_html(html)
    yield _Raw({"path": rel}, id=rel, text=text, metadata={**metadata, "path": rel})


def extract_html(html: str) -> tuple[str, dict[str, Any]]:
    """Title + main text of a page, and its url/title/extractor as metadata.

    trafilatura drops navigation and boilerplate; it returns nothing for pages it judges too
    small, and those fall back to the whole visible text so that short pages are not lost.
    """
    result = trafilatura.bare_extraction(html, with_metadata=True, include_comments=False)
    title = url = None
    body = ""
    if result:
        title, url, body = result.get("title"), result.get("url"), result.get("text") or ""
    metadata: dict[str, Any] = {"url": url, "title": title, "extractor": "trafilatura"}
    if not body.strip():
        body = _visible_text(html)
        metadata["extractor"] = "lxml"
    if title and not body.startswith(title):
        body = f"{title}\n\n{body}"
    return body, metadata


def _visible_text(html: str) -> str:
    try:
        tree = lxml.html.document_fromstring(html)
    except ParserError:  # an empty or whitespace-only page
        return ""
    for element in tree.xpath("//script|//style|//noscript"):
        element.drop_tree()
    lines = (" ".join(line.split()) for line in tree.text_content().splitlines())
    return "\n".join(line for line in lines if line)


_READERS = {"jsonl": _read_jsonl, "txt": _read_txt, "html": _read_html}


def collect_documents(cfg: CollectConfig, out_dir: Path) -> dict:
    """Read every source into `out_dir/documents.jsonl` and write the compliance report."""
    _check_sources(cfg)
    allowed = {licence.strip().lower() for licence in cfg.allowed_licences}
    counts = DocCounts()
    reports = []
    seen_ids: set[str] = set()
    by_domain: Counter[str] = Counter()
    with (
        open(out_dir / DOCUMENTS_FILE, "w", encoding="utf-8") as kept,
        ReasonLog(out_dir / REMOVED_FILE) as removed,
        ReasonLog(out_dir / QUARANTINE_FILE) as quarantine,
    ):
        for source in cfg.sources:
            report = _SourceReport(source.name, source.path, source.format, source.domain, source.licence)
            reports.append(report)
            files = _files(source)
            report.num_files = len(files)
            for file, rel in files:
                if report.capped:
                    break
                for raw in _READERS[source.format](file, rel):
                    if cfg.max_docs_per_source is not None and report.num_kept >= cfg.max_docs_per_source:
                        report.capped = True
                        break
                    counts.num_in += 1
                    reason, doc = _judge(raw, source, cfg.min_chars, allowed, seen_ids)
                    log_record = {"source": source.name, **raw.location}
                    if reason is None:
                        assert doc is not None
                        seen_ids.add(doc.id)
                        kept.write(doc.to_json() + "\n")
                        counts.num_kept += 1
                        report.num_kept += 1
                        report.num_chars += len(doc.text)
                        report.licences[doc.licence] += 1
                        by_domain[source.domain] += 1
                    elif doc is not None:  # readable, but its licence is not allowed
                        removed.add(reason, {**log_record, "document": json.loads(doc.to_json())})
                        counts.removed[reason] += 1
                        report.removed[reason] += 1
                        report.licences[doc.licence] += 1
                    else:
                        detail = {"detail": raw.detail} if raw.detail else {}
                        raw_input = {"raw": raw.raw} if raw.raw is not None else {}
                        quarantine.add(reason, {**log_record, **detail, **raw_input})
                        counts.quarantined[reason] += 1
                        report.quarantined[reason] += 1
    compliance = _compliance(reports, allowed)
    (out_dir / "compliance.json").write_text(json.dumps(compliance, indent=2) + "\n", encoding="utf-8")
    (out_dir / "compliance.md").write_text(_compliance_markdown(compliance), encoding="utf-8")
    return {
        **counts.as_dict(),
        "by_source": {r.name: r.num_kept for r in reports},
        "by_domain": dict(sorted(by_domain.items())),
        "num_chars": sum(r.num_chars for r in reports),
    }


def _judge(
    raw: _Raw, source: SourceConfig, min_chars: int, allowed: set[str], seen_ids: set[str]
) -> tuple[str | None, Document | None]:
    """(None, doc) to keep; (reason, doc) to remove; (reason, None) to quarantine."""
    if raw.problem is not None:
        return raw.problem, None
    assert raw.text is not None
    licence = raw.licence or source.licence
    if licence is None:
        return "missing_licence", None
    if len(raw.text.strip()) < min_chars:
        return "empty_text", None
    if raw.id is not None:
        doc_id = f"{source.name}/{raw.id}"
    else:
        doc_id = f"{source.name}/{raw.location['path']}:{raw.location['line']}"
    if doc_id in seen_ids:
        raw.detail = f"id {doc_id!r} was already used by an earlier record"
        return "duplicate_id", None
    doc = Document(doc_id, raw.text, source.name, source.domain, licence, raw.metadata)
    if licence.strip().lower() not in allowed:
        return f"licence_not_allowed:{licence}", doc
    return None, doc


def _compliance(reports: list[_SourceReport], allowed: set[str]) -> dict[str, Any]:
    return {
        "allowed_licences": sorted(allowed),
        "sources": [
            {
                "name": r.name,
                "path": r.path,
                "format": r.format,
                "domain": r.domain,
                "declared_licence": r.declared_licence,
                "licences": {
                    licence: {"allowed": licence.strip().lower() in allowed, "num_docs": n}
                    for licence, n in sorted(r.licences.items())
                },
                "num_files": r.num_files,
                "num_kept": r.num_kept,
                "num_removed": sum(r.removed.values()),
                "num_quarantined": sum(r.quarantined.values()),
                "quarantined": dict(sorted(r.quarantined.items())),
                "capped": r.capped,
            }
            for r in reports
        ],
    }


def _compliance_markdown(compliance: dict[str, Any]) -> str:
    lines = [
        "# Collect: licence compliance",
        "",
        "| source | path | licences seen | kept | removed | quarantined |",
        "|---|---|---|---|---|---|",
    ]
    for s in compliance["sources"]:
        seen = ", ".join(
            f"{licence} ({'allowed' if info['allowed'] else 'NOT allowed'}, {info['num_docs']})"
            for licence, info in s["licences"].items()
        )
        lines.append(
            f"| {s['name']} | `{s['path']}` | {seen or '-'} | {s['num_kept']} | "
            f"{s['num_removed']} | {s['num_quarantined']} |"
        )
    return "\n".join(lines) + "\n"
