"""Source files → candidate documents: one reader per format (jsonl, txt, html), none of which raises on content.

A reader turns whatever bytes a file holds into `Candidate`s: a document to judge, or a problem
(a quarantine reason) with the file and line at fault. What counts as a problem is decided in
`tasks.data.untrusted` (JSON limits, surrogates) and `tasks.data.html_text` (pages no extractor
reads); the size limit `max_bytes` applies to a jsonl line or a whole txt/html file, and is
checked before the input is read into memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.data.html_text import UnreadableHtml, extract_html
from tasks.data.untrusted import (
    RAW_PREFIX_CHARS,
    has_surrogates,
    is_blank,
    parse_json,
    read_lines,
    repair_surrogates,
)

_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; JSON parsers refuse it


@dataclass
class Candidate:
    """One candidate document as read from a file, before licence and length checks."""

    location: dict[str, Any]  # path (and line) of the input, carried into every log record
    id: str | None = None
    text: str | None = None
    licence: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # quarantine reason
    detail: str = ""
    raw: str | None = None  # the unparsed input, kept in quarantine so nothing is lost
    raw_prefix: str | None = None  # ...or its start, for an input too large to copy
    num_repaired: int = 0  # strings whose lone surrogates were replaced


def _too_large(location: dict[str, Any], size: int, max_bytes: int, prefix: bytes = b"") -> Candidate:
    return Candidate(
        location, problem="too_large", detail=f"{size} bytes; the limit is collect.max_doc_bytes={max_bytes}",
        raw_prefix=prefix.decode("utf-8", errors="backslashreplace") if prefix else None,
    )


def read_jsonl(file: Path, rel: str, max_bytes: int) -> Iterator[Candidate]:
    with open(file, "rb") as handle:
        for line in read_lines(handle, max_bytes):
            location = {"path": rel, "line": line.number}
            if line.data is None:
                yield _too_large(location, line.size, max_bytes, line.prefix)
                continue
            data = line.data.removeprefix(_BOM) if line.number == 1 else line.data
            if is_blank(data):
                continue  # not a record
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Candidate(location, problem="non_utf8", detail=str(err),
                                raw=data.decode("utf-8", errors="backslashreplace"))  # fmt: skip
                continue
            record, problem = parse_json(text)
            if problem is not None:
                yield Candidate(location, problem=problem.reason, detail=problem.detail, raw=text)
                continue
            repaired = 0
            if has_surrogates(text):
                record, repaired = repair_surrogates(record)
            yield _from_record(record, location, text, repaired)


def _licence_field(record: dict[str, Any]) -> tuple[str | None, str | None]:
    """(licence, problem detail): records spell it `licence` or `license`; both must agree."""
    spelled = {key: record[key] for key in ("licence", "license") if record.get(key) is not None}
    for key, value in spelled.items():
        if not isinstance(value, str):
            return None, f"'{key}' must be a string (an SPDX expression), not {type(value).__name__}"
    values = {value.strip() for value in spelled.values() if value.strip()}
    if len(values) > 1:
        return None, f"'licence' {spelled['licence']!r} and 'license' {spelled['license']!r} disagree"
    return (values.pop() if values else None), None


def _from_record(record: Any, location: dict[str, Any], line: str, repaired: int) -> Candidate:
    def bad(problem: str, detail: str = "") -> Candidate:
        return Candidate(location, problem=problem, detail=detail, raw=line, num_repaired=repaired)

    if not isinstance(record, dict):
        return bad("not_an_object")
    text = record.get("text")
    if not isinstance(text, str):
        return bad("missing_text", "no string field 'text'")
    record_id = record.get("id")
    if record_id is not None and (isinstance(record_id, bool) or not isinstance(record_id, (str, int))):
        return bad("invalid_id", "'id' must be a string or integer")
    metadata = record.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return bad("invalid_metadata", "'metadata' must be an object")
    licence, licence_problem = _licence_field(record)
    if licence_problem is not None:
        return bad("invalid_licence", licence_problem)
    return Candidate(
        location,
        id=None if record_id is None else str(record_id),
        text=text,
        licence=licence,
        metadata={**(metadata or {}), **location},
        num_repaired=repaired,
    )


def _read_whole(file: Path, rel: str, max_bytes: int) -> tuple[str | None, Candidate | None]:
    """The file's text, or a quarantine candidate if it is too large or not UTF-8."""
    location = {"path": rel}
    size = file.stat().st_size
    if size > max_bytes:
        with open(file, "rb") as handle:
            return None, _too_large(location, size, max_bytes, handle.read(RAW_PREFIX_CHARS))
    try:
        return file.read_bytes().decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, Candidate(location, problem="non_utf8", detail=str(err))


def read_txt(file: Path, rel: str, max_bytes: int) -> Iterator[Candidate]:
    text, bad = _read_whole(file, rel, max_bytes)
    yield bad or Candidate({"path": rel}, id=rel, text=text, metadata={"path": rel})


def read_html(file: Path, rel: str, max_bytes: int) -> Iterator[Candidate]:
    html, bad = _read_whole(file, rel, max_bytes)
    if bad is not None:
        yield bad
        return
    try:
        text, metadata = extract_html(html)
    except UnreadableHtml as err:
        yield Candidate({"path": rel}, problem="unreadable_html", detail=str(err))
        return
    yield Candidate({"path": rel}, id=rel, text=text, metadata={**metadata, "path": rel})


READERS: dict[str, Callable[[Path, str, int], Iterator[Candidate]]] = {
    "jsonl": read_jsonl, "txt": read_txt, "html": read_html,
}
