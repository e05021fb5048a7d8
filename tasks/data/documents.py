"""The document record every data stage reads and writes, as JSON lines, and the shard files that hold them.

One record per line: `{"id", "text", "source", "domain", "licence", "metadata"}`. Stages stream
these files rather than holding a corpus in memory, and write removed or quarantined records beside
their output with a `reason`, so nothing is lost silently. Between stages the lines live in shards,
zstd-compressed JSON lines (`documents/00000.jsonl.zst`; `tasks.data.shards` lays them out): the
same bytes as a plain `.jsonl`, a third of the size, read and written as streams.

This module is the one reader of those files, whoever reads them (every data stage, `kiln inspect`,
datatrove pipelines, the quality model's training): `read_lines` yields each record's raw line, the
bytes a stage that keeps the record unchanged writes back without parsing it; `parse_line` parses
one when it is needed, with orjson (several times stdlib json's speed), falling back to `json` for
the JSON orjson refuses (lone surrogates escaped as `\\udXXX`, NaN, integers beyond 64 bits), so
every line parses to what `json.loads` gives. `read_records` and `read_documents` are the two
parsed views.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import zstandard

from kiln.tasks.store import HashingFile

SHARD_SUFFIX = ".jsonl.zst"
ZSTD_LEVEL = 3  # zstd's default: ~4x smaller than the JSON at hundreds of MB/s; the same bytes on every run
_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False) without a new encoder a call


@dataclass
class Document:
    id: str
    text: str
    source: str
    domain: str
    licence: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        # vars, not asdict: the same JSON (every field is JSON already) without a deep copy of each record
        return json.dumps(vars(self), ensure_ascii=False)

    def to_json_line(self) -> bytes:
        """`to_json()` and a newline, as UTF-8. The text, nearly all of a record's bytes, is encoded by
        orjson, several times faster: its escaping equals `json.dumps(ensure_ascii=False)`'s for every
        string it accepts (tests check every code point); the short fields go through `json`."""
        fields = vars(self)
        if not isinstance(self.text, str):
            return (self.to_json() + "\n").encode("utf-8")
        try:
            text = orjson.dumps(self.text)
        except orjson.JSONEncodeError:  # lone surrogates: json's path, with its error
            return (self.to_json() + "\n").encode("utf-8")
        tail = _ENCODER.encode({k: v for k, v in fields.items() if k not in ("id", "text")})[1:]
        return b"".join((b'{"id": ', encode_basestring(self.id).encode("utf-8"), b', "text": ', text, b", ",
                         tail.encode("utf-8"), b"\n"))

    @classmethod
    def from_line(cls, line: bytes) -> Document:
        """The document a record line (`read_lines`) holds."""
        return cls.from_dict(parse_line(line))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Document:
        return cls(
            id=str(record["id"]),
            text=record["text"],
            source=record["source"],
            domain=record["domain"],
            licence=record["licence"],
            metadata=dict(record.get("metadata") or {}),
        )


def open_lines(path: Path) -> BinaryIO:
    """A documents file (`.jsonl`, or zstd-compressed `.jsonl.zst`) as a binary stream of its lines."""
    raw = open(path, "rb")
    if path.name.endswith(".zst"):
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return raw


def read_lines(path: Path) -> Iterator[bytes]:
    """Each record of a documents file as its raw line: UTF-8 bytes ending in a newline (a last line
    without one gets it); blank lines are no records and are skipped. Parse a line with `parse_line`
    only where its content is needed."""
    with open_lines(path) as handle:
        for line in handle:
            if line.strip():
                yield line if line.endswith(b"\n") else line + b"\n"


def parse_line(line: bytes) -> dict[str, Any]:
    """One record line as `json.loads` reads it: by orjson, or by `json` where orjson differs on valid
    JSON that Kiln's files may hold: it refuses a lone surrogate's escape and NaN, and reads an integer
    beyond 64 bits as a float (so a float that large sends the line to `json` too)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)
    return json.loads(line) if _holds_huge_float(record) else record


_HUGE = 2.0**63  # orjson reads an integer literal outside int64 and uint64 as a float at least this large


def _holds_huge_float(value: Any) -> bool:
    # A plain loop, no generator: it runs on every record parsed, and most values are strings.
    kind = type(value)
    if kind is float:
        return not -_HUGE < value < _HUGE
    if kind is dict or kind is list:
        for item in value.values() if kind is dict else value:
            item_kind = type(item)
            if item_kind is float:
                if not -_HUGE < item < _HUGE:
                    return True
            elif (item_kind is dict or item_kind is list) and _holds_huge_float(item):
                return True
    return False


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of a documents file, parsed: documents, or removed and quarantined records."""
    for line in read_lines(path):
        yield parse_line(line)


def read_documents(path: Path) -> Iterator[Document]:
    """Stream documents written by a previous Kiln stage (trusted format: errors are bugs)."""
    for line in read_lines(path):
        yield Document.from_line(line)


def read_shards(paths: Iterable[Path]) -> Iterator[Document]:
    """The documents of several files, one after another."""
    for path in paths:
        yield from read_documents(path)


def write_documents(path: Path, documents: Iterable[Document]) -> int:
    """Write documents as JSON lines (zstd-compressed when `path` ends in `.zst`); returns how many."""
    with ShardWriter(path) as writer:
        for doc in documents:
            writer.write_line(doc.to_json_line())
        writer.touch()
        return writer.num_records


class ShardWriter:
    """One file of JSON-line records, zstd-compressed when its name ends in `.zst`: kept documents
    (`write_line(doc.to_json_line())`) or records that left the stream with the reason why (`add`).
    The file is created by the first record, so a shard nothing went to does not exist; it counts
    what it holds while writing, and hashes the file's bytes as they are written (`store.HashingFile`)."""

    def __init__(self, path: Path):
        self.path = path
        self.num_records = 0
        self.num_bytes = 0  # uncompressed
        self._handle: Any = None  # a HashingFile, or zstd writing into one

    def add(self, reason: str, record: dict[str, Any]) -> None:
        self.write_line((_ENCODER.encode({"reason": reason, **record}) + "\n").encode("utf-8"))

    def write_line(self, line: bytes) -> None:
        """One record already serialised (UTF-8, ending in a newline)."""
        if self._handle is None:
            self.touch()
        assert self._handle is not None
        self._handle.write(line)
        self.num_records += 1
        self.num_bytes += len(line)

    def write_lines(self, block: bytes, num_records: int) -> None:
        """`num_records` whole records already serialised and joined (a run of another file's lines)."""
        if self._handle is None:
            self.touch()
        assert self._handle is not None
        self._handle.write(block)
        self.num_records += num_records
        self.num_bytes += len(block)

    def touch(self) -> None:
        """Create the file now, even if no record follows."""
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            raw = HashingFile(self.path)  # hashed as written: the store's commit does not read it again
            compressed = self.path.name.endswith(".zst")
            self._handle = zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(raw) if compressed else raw

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
