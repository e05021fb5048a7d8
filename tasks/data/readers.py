"""Source files → candidate documents: one reader per format, none of which raises on content.

A reader turns whatever bytes a file holds into `Candidate`s: a document to judge, or a problem
(a quarantine reason) with the location at fault: a file and line (jsonl), a file and row
(parquet, Hugging Face datasets), a file and record offset (WARC), or a file (txt, html, code).
What counts as a problem is decided in `tasks.data.untrusted` (JSON limits, surrogates) and
`tasks.data.html_text` (pages no extractor reads); the size limit `max_bytes` applies to a jsonl
line, a table row, a WARC record or a whole txt/html file, and is checked before the input is read
into memory where the format allows (a parquet row is decoded in a batch before it can be measured).

Table rows (parquet, datasets) go through the same JSON checks as jsonl lines: a row is serialised
to JSON and parsed back, so one set of rules decides what a record may hold, whatever its format.
Code trees have their own reader (`tasks.data.code_tree`); files come from `tasks.data.source_files`.
"""

from __future__ import annotations

import datetime
import decimal
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.tasks.data.html_text import UnreadableHtml, extract_html
from kiln.tasks.data.source_files import SourceFile, compression_of, decompressed
from kiln.tasks.data.untrusted import (
    RAW_PREFIX_CHARS,
    Line,
    has_surrogates,
    is_blank,
    parse_json,
    read_lines,
    repair_surrogates,
)

if TYPE_CHECKING:
    from kiln.tasks.data.sources import Source

_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; JSON parsers refuse it
_RECORD_FIELDS = frozenset(("text", "id", "licence", "license", "metadata"))  # a record's own; the rest is metadata


@dataclass
class Candidate:
    """One candidate document as read from a file, before licence and length checks."""

    location: dict[str, Any]  # path (and line) of the input, carried into every log record
    id: str | None = None
    text: str | None = None
    licence: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # quarantine reason
    skip: str | None = None  # removal reason of an input that is readable but no document (a vendored file)
    detail: str = ""
    raw: str | None = None  # the unparsed input, kept in quarantine so nothing is lost
    raw_prefix: str | None = None  # ...or its start, for an input too large to copy
    num_repaired: int = 0  # strings whose lone surrogates were replaced


def too_large(location: dict[str, Any], size: int, max_bytes: int, prefix: bytes = b"") -> Candidate:
    """An input over collect.max_doc_bytes, quarantined unread but for its first bytes."""
    return Candidate(
        location, problem="too_large", detail=f"{size} bytes; the limit is collect.max_doc_bytes={max_bytes}",
        raw_prefix=prefix.decode("utf-8", errors="backslashreplace") if prefix else None,
    )


def _corrupt_stream_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged compressed stream raises: gzip's, zlib's and zstandard's errors."""
    import zstandard

    return (OSError, EOFError, zlib.error, zstandard.ZstdError)


def read_jsonl(file: SourceFile, source: Source, max_bytes: int) -> Iterator[Candidate]:
    """One record per line; `.gz` and `.zst` files are read as streams. A damaged compressed
    stream is quarantined as `corrupt_file` at the line where it breaks: nothing after it can be read."""
    with file.open() as raw:
        stream = decompressed(raw, compression_of(file.rel, getattr(source, "compression", "infer")))
        lines = read_lines(stream, max_bytes)
        number = 0
        while True:
            try:
                line = next(lines, None)
            except _corrupt_stream_errors() as err:
                yield Candidate({"path": file.rel, "line": number + 1}, problem="corrupt_file",
                                detail=f"{type(err).__name__}: {err}"[:500])
                return
            if line is None:
                return
            number = line.number
            yield from _jsonl_line(line, file.rel, max_bytes)


def read_jsonl_range(file: SourceFile, source: Source, max_bytes: int, start: int, end: int,
                     newlines_before: int) -> Iterator[Candidate]:
    """The records of an uncompressed jsonl file whose lines start at bytes [start, end): the same
    candidates, numbered the same, as `read_jsonl` gives for those lines. `newlines_before`: the
    newlines in bytes [0, start), which number the lines. A line that starts before `start` is the
    previous range's, however long; the last line that starts before `end` is read to its end."""
    with file.open() as raw:
        handle = decompressed(raw, None)
        number = newlines_before
        if start > 0:
            handle.seek(start - 1)
            if handle.read(1) != b"\n":  # inside a line the previous range reads: skip to its end
                while (chunk := handle.readline(_SKIP_CHUNK)) and not chunk.endswith(b"\n"):
                    pass
                if not chunk:
                    return
                number += 1
        for line in read_lines(_Until(handle, end), max_bytes):
            yield from _jsonl_line(Line(number + line.number, line.data, line.size, line.prefix), file.rel, max_bytes)


_SKIP_CHUNK = 1 << 20


class _Until:
    """A file's lines up to the first that starts at or after byte `end` (`readline` only)."""

    def __init__(self, handle: Any, end: int):
        self.handle, self.end, self.at_line_start = handle, end, True

    def readline(self, size: int = -1) -> bytes:
        if self.at_line_start and self.handle.tell() >= self.end:
            return b""
        chunk = self.handle.readline(size)
        self.at_line_start = chunk.endswith(b"\n")
        return chunk


def _jsonl_line(line: Line, rel: str, max_bytes: int) -> Iterator[Candidate]:
    location = {"path": rel, "line": line.number}
    if line.data is None:
        yield too_large(location, line.size, max_bytes, line.prefix)
        return
    data = line.data.removeprefix(_BOM) if line.number == 1 else line.data
    if is_blank(data):
        return  # not a record
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield Candidate(location, problem="non_utf8", detail=str(err),
                        raw=data.decode("utf-8", errors="backslashreplace"))  # fmt: skip
        return
    yield _from_json_text(text, location)


def _from_json_text(text: str, location: dict[str, Any]) -> Candidate:
    """A record written as JSON text (a jsonl line, or a table row serialised by `_row_json`)."""
    record, problem = parse_json(text)
    if problem is not None:
        return Candidate(location, problem=problem.reason, detail=problem.detail, raw=text)
    repaired = 0
    if has_surrogates(text):
        record, repaired = repair_surrogates(record)
    return _from_record(record, location, text, repaired)


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
    # Every other field (`lang`, `source`, a `domain` for `domain_field`...) is metadata, as a table's
    # other columns are (`_row_json`): a field beside `metadata` wins over the same key inside it.
    extra = {key: value for key, value in record.items() if key not in _RECORD_FIELDS}
    return Candidate(
        location,
        id=None if record_id is None else str(record_id),
        text=text,
        licence=licence,
        metadata={**(metadata or {}), **extra, **location},
        num_repaired=repaired,
    )


def _read_whole(file: SourceFile, max_bytes: int) -> tuple[str | None, Candidate | None]:
    """The file's text, or a quarantine candidate if it is too large or not UTF-8."""
    location = {"path": file.rel}
    with file.open() as handle:
        if file.size > max_bytes:
            return None, too_large(location, file.size, max_bytes, handle.read(RAW_PREFIX_CHARS))
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # the listing's size was stale
        return None, too_large(location, len(data), max_bytes, data[:RAW_PREFIX_CHARS])
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, Candidate(location, problem="non_utf8", detail=str(err))


def read_txt(file: SourceFile, source: Source, max_bytes: int) -> Iterator[Candidate]:
    text, bad = _read_whole(file, max_bytes)
    yield bad or Candidate({"path": file.rel}, id=file.rel, text=text, metadata={"path": file.rel})


def _html_candidate(html: str, location: dict[str, Any], doc_id: str, extra: dict[str, Any]) -> Candidate:
    try:
        text, metadata = extract_html(html)
    except UnreadableHtml as err:
        return Candidate(location, problem="unreadable_html", detail=str(err))
    return Candidate(location, id=doc_id, text=text, metadata={**metadata, **extra, **location})


def read_html(file: SourceFile, source: Source, max_bytes: int) -> Iterator[Candidate]:
    html, bad = _read_whole(file, max_bytes)
    yield bad or _html_candidate(html, {"path": file.rel}, file.rel, {})


# --- tables: parquet files and Hugging Face datasets -------------------------------------------

_ROW_BATCH = 256  # rows decoded at a time: bounds memory on files with large row groups


def _json_default(value: Any) -> Any:
    """Column types JSON lacks: dates and times as ISO 8601, decimals as strings; others are refused."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"a {type(value).__name__} value has no JSON form; leave its column out (the source's `columns`)")


def _row_json(row: dict[str, Any], text_column: str, id_column: str | None) -> str:
    """A table row as a Kiln record in JSON: text and id from their columns, licence as spelled,
    every other column in `metadata` (merged into a `metadata` column that is an object)."""
    record: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for name, value in row.items():
        if name == text_column:
            record["text"] = value
        elif name == id_column:
            record["id"] = value
        elif name in ("licence", "license"):
            record[name] = value
        elif name == "metadata" and isinstance(value, dict):
            metadata = {**value, **metadata}
        else:
            metadata[name] = value
    if metadata:
        record["metadata"] = metadata
    return json.dumps(record, ensure_ascii=False, default=_json_default)


def _from_row(row: dict[str, Any], location: dict[str, Any], source: Source, max_bytes: int) -> Candidate:
    try:
        text = _row_json(row, source.text_column, source.id_column)
    except (TypeError, ValueError) as err:  # a value JSON cannot hold; a circular structure
        return Candidate(location, problem="unsupported_value", detail=str(err)[:500])
    except RecursionError:
        return Candidate(location, problem="json_too_deep", detail="a value nested too deep to serialise")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        return too_large(location, size, max_bytes, text[:RAW_PREFIX_CHARS].encode("utf-8", errors="surrogatepass"))
    return _from_json_text(text, location)


def read_parquet(file: SourceFile, source: Source, max_bytes: int) -> Iterator[Candidate]:
    """One record per row, in row-group batches. A file pyarrow cannot open is one quarantined
    input (`unreadable_parquet`); one that breaks part-way is quarantined from the failing row on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    broken = (pa.ArrowException, OSError, EOFError)
    with file.open() as handle:
        try:
            table = pq.ParquetFile(handle)
            batches = table.iter_batches(batch_size=_ROW_BATCH, columns=source.columns)
        except broken as err:
            yield Candidate({"path": file.rel}, problem="unreadable_parquet", detail=f"{type(err).__name__}: {err}"[:500])
            return
        row = 0
        while True:
            try:
                batch = next(batches, None)
                rows = [] if batch is None else batch.to_pylist()
            except broken as err:
                yield Candidate({"path": file.rel, "row": row}, problem="unreadable_parquet",
                                detail=f"{type(err).__name__}: {err}"[:500])
                return
            if batch is None:
                return
            for values in rows:
                yield _from_row(values, {"path": file.rel, "row": row}, source, max_bytes)
                row += 1


def read_dataset(source: Source, max_bytes: int) -> Iterator[Candidate]:
    """A Hugging Face dataset through `datasets` itself: `load_from_disk` for a folder written by
    `save_to_disk`, else `load_dataset` streaming (a hub id, a local dataset folder, or a builder
    such as `parquet`/`json` with `data_files`). Loading needs nothing from the network for a local
    folder. A dataset that fails part-way (a damaged data file) is quarantined from that row on."""
    location = {"path": source.path, "split": source.split}
    rows = None
    row = 0
    while True:
        try:
            if rows is None:
                rows = iter(_load_dataset(source))
            values = next(rows, None)
        # Loading and iterating run datasets' builders and pyarrow over files anyone may have written:
        # they raise OSError, ValueError, IndexError (an empty saved dataset) and more. One damaged
        # file ends this source, quarantined with the row it reached.
        except Exception as err:  # noqa: BLE001
            yield Candidate({**location, "row": row}, problem="unreadable_dataset",
                            detail=f"{type(err).__name__}: {err}"[:500])
            return
        if values is None:
            return
        yield _from_row(values, {**location, "row": row}, source, max_bytes)
        row += 1


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a local folder written by `Dataset.save_to_disk` (or `DatasetDict`'s)."""
    from pathlib import Path

    root = Path(path.removeprefix("file://"))
    return (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()


def _load_dataset(source: Source):
    import datasets

    if is_saved_dataset(source.path):
        loaded = datasets.load_from_disk(source.path.removeprefix("file://"), storage_options=source.storage_options or None)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise ValueError(f"split {source.split!r} is not one of {sorted(loaded)}")
            loaded = loaded[source.split]
        columns = source.columns
        return loaded.select_columns(columns) if columns else loaded
    loaded = datasets.load_dataset(
        source.path, source.config_name, split=source.split, data_files=source.data_files,
        revision=source.revision, streaming=True, storage_options=source.storage_options or None,
    )
    return loaded.select_columns(source.columns) if source.columns else loaded


# --- WARC ---------------------------------------------------------------------------------------


def read_warc(file: SourceFile, source: Source, max_bytes: int) -> Iterator[Candidate]:
    """One candidate per response (or WET conversion) record; warcinfo, request and metadata
    records hold no document and are not inputs. Each record's payload is decoded by datatrove's
    WARC reader (`process_record`: payload type, charset detection, URL and crawl date) and its
    main text extracted by trafilatura (`tasks.data.html_text`). Locations are the record's byte
    offset in the file (compressed offset for `.warc.gz`); a stream that breaks is quarantined
    as `corrupt_warc` at the offset where reading stopped."""
    from datatrove.pipeline.readers.warc import process_record
    from warcio.archiveiterator import ArchiveIterator

    with file.open() as handle:
        records = None
        offset = 0
        while True:
            try:
                if records is None:
                    records = ArchiveIterator(handle)
                record = next(records, None)
                if record is None:
                    return
                offset = records.offset  # the record's start (get_record_offset() would read its payload away)
            except Exception as err:  # noqa: BLE001 — warcio on damaged bytes raises many kinds; the rest is unreadable
                offset = getattr(records, "offset", offset)  # the start of the record it could not read
                yield Candidate({"path": file.rel, "offset": offset}, problem="corrupt_warc",
                                detail=f"{type(err).__name__}: {err}"[:500])
                return
            if record.rec_type not in ("response", "conversion"):
                continue
            yield _warc_candidate(record, process_record, {"path": file.rel, "offset": offset}, max_bytes)


_PAYLOAD_TYPE = "WARC-Identified-Payload-Type"


_HTML_TYPES = ("text/html", "application/xhtml+xml")  # what process_record reads as HTML


def _declare_payload_type(record: Any) -> None:
    """Mark a response without `WARC-Identified-Payload-Type` as HTML when its HTTP `Content-Type`
    says so. datatrove's `process_record` trusts that header and otherwise sniffs the body with
    libmagic, which calls an HTML page that does not open with `<html>` or a doctype (a fragment, a
    page starting with `<div>`) text/plain. Any other declared type is left to the sniffing, which
    still finds HTML a server labelled wrongly."""
    if record.rec_headers.get_header(_PAYLOAD_TYPE) is not None or record.http_headers is None:
        return
    media_type = (record.http_headers.get_header("Content-Type") or "").split(";", 1)[0].strip().lower()
    if media_type in _HTML_TYPES:
        record.rec_headers.add_header(_PAYLOAD_TYPE, media_type)


def _warc_candidate(record: Any, process_record: Callable, location: dict[str, Any], max_bytes: int) -> Candidate:
    length = record.rec_headers.get_header("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        return too_large(location, int(length), max_bytes)
    _declare_payload_type(record)
    try:
        extracted = process_record(record)
    except Exception as err:  # noqa: BLE001 — one damaged record (bad content encoding, missing URI); the next may be fine
        return Candidate(location, problem="unreadable_warc_record", detail=f"{type(err).__name__}: {err}"[:500])
    if not extracted:
        payload = record.rec_headers.get_header(_PAYLOAD_TYPE)
        if payload is None and record.http_headers is not None:
            payload = record.http_headers.get_header("Content-Type")
        return Candidate(location, problem="not_html", detail=f"payload {payload or 'of unknown type'} (or an undecodable charset)")
    url, date = extracted.get("url"), extracted.get("date")
    record_id = str(extracted["id"]).strip().removeprefix("<").removesuffix(">")  # <urn:uuid:...> → urn:uuid:...
    return _html_candidate(extracted["text"], location, record_id, {"url": url, "crawl_date": date})


READERS: dict[str, Callable[[SourceFile, Source, int], Iterator[Candidate]]] = {
    "jsonl": read_jsonl, "txt": read_txt, "html": read_html, "parquet": read_parquet, "warc": read_warc,
}
