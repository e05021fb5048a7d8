"""The document record every data stage reads and writes, as JSON lines.

One record per line: `{"id", "text", "source", "domain", "licence", "metadata"}`. Stages
stream these files rather than holding a corpus in memory, and write removed or
quarantined records beside their output with a `reason`, so nothing is lost silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, BinaryIO

import orjson

DOCUMENTS_FILE = "documents.jsonl"
REMOVED_FILE = "removed.jsonl"
QUARANTINE_FILE = "quarantine.jsonl"
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
    def from_dict(cls, record: dict[str, Any]) -> Document:
        return cls(
            id=str(record["id"]),
            text=record["text"],
            source=record["source"],
            domain=record["domain"],
            licence=record["licence"],
            metadata=dict(record.get("metadata") or {}),
        )


def read_documents(path: Path) -> Iterator[Document]:
    """Stream documents written by a previous Kiln stage (trusted format: errors are bugs)."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield Document.from_dict(json.loads(line))


def write_documents(path: Path, documents: Iterable[Document]) -> int:
    """Write documents as JSON lines; returns how many were written."""
    count = 0
    with open(path, "wb") as handle:
        for doc in documents:
            handle.write(doc.to_json_line())
            count += 1
    return count


class ReasonLog:
    """Appends records that left the stream (removed or quarantined) with the reason why. The file
    is created by the first record, so a stage that removes nothing leaves none."""

    def __init__(self, path: Path):
        self.path = path
        self._handle: BinaryIO | None = None

    def add(self, reason: str, record: dict[str, Any]) -> None:
        self.write_line((_ENCODER.encode({"reason": reason, **record}) + "\n").encode("utf-8"))

    def write_line(self, line: bytes) -> None:
        """One record already serialised as `add` would write it (UTF-8, ending in a newline)."""
        if self._handle is None:
            self._handle = open(self.path, "wb")
        self._handle.write(line)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> ReasonLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
