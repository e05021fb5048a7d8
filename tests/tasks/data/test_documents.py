"""`Document.to_json_line` must write exactly the bytes of `to_json()`: dedup writes kept lines back
byte for byte only when they equal it, and every stage's output hash depends on it. The one reader
(`read_lines`, `parse_line`) gives each record's bytes as written and parses them as `json.loads` does."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.tasks.data.documents import Document, ShardWriter, parse_line, read_documents, read_lines, read_records, write_documents

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def _expected(doc: Document) -> bytes:
    return (doc.to_json() + "\n").encode("utf-8")


def test_every_code_point_is_escaped_as_json_escapes_it() -> None:
    code_points = [c for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    chunks = ["".join(map(chr, code_points[lo : lo + 4096])) for lo in range(0, len(code_points), 4096)]
    for text in chunks:
        doc = Document("id", text, "src", "web", "MIT")
        assert doc.to_json_line() == _expected(doc)


@settings(max_examples=300, deadline=None)
@given(doc_id=st.text(), text=st.text(), source=st.text(), metadata=st.dictionaries(st.text(), _JSON_VALUES))
def test_equals_to_json_for_any_document(doc_id: str, text: str, source: str, metadata: dict) -> None:
    doc = Document(doc_id, text, source, "prose", "CC-BY-4.0", metadata)
    try:
        expected = _expected(doc)
    except UnicodeEncodeError:  # a lone surrogate: neither form can be written as UTF-8
        with pytest.raises(UnicodeEncodeError):
            doc.to_json_line()
        return
    assert doc.to_json_line() == expected


def test_a_text_that_is_not_a_string_is_written_as_to_json_writes_it() -> None:
    doc = Document.from_dict({"id": 7, "text": ["a", 1], "source": "s", "domain": "d", "licence": "MIT"})
    assert doc.to_json_line() == _expected(doc)


def test_written_documents_read_back_equal(tmp_path) -> None:
    docs = [Document("a", 'line one\nsaid "hi"\t\\ é 中文 \U0001f600', "s", "web", "MIT", {"quality_score": 0.5}),
            Document("b", "", "s", "code", "GPL-2.0-or-later")]
    path = tmp_path / "documents.jsonl"
    assert write_documents(path, docs) == 2
    assert list(read_documents(path)) == docs
    assert path.read_bytes() == b"".join(_expected(d) for d in docs)
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()][1]["text"] == ""


def test_a_shard_is_the_same_lines_zstd_compressed(tmp_path) -> None:
    import zstandard

    docs = [Document(f"d{i}", f"text {i} é 中文\n" * 50, "s", "web", "MIT") for i in range(200)]
    plain, shard = tmp_path / "documents.jsonl", tmp_path / "00000.jsonl.zst"
    write_documents(plain, docs)
    assert write_documents(shard, docs) == 200
    assert zstandard.ZstdDecompressor().stream_reader(shard.read_bytes()).read() == plain.read_bytes()
    assert list(read_documents(shard)) == docs
    assert shard.stat().st_size < plain.stat().st_size / 4
    assert write_documents(tmp_path / "empty.jsonl.zst", []) == 0 and list(read_documents(tmp_path / "empty.jsonl.zst")) == []


def test_lines_are_read_as_written_and_parsed_as_json_reads_them(tmp_path) -> None:
    """orjson parses; where it would differ from json (a lone surrogate's escape, NaN, integers beyond 64
    bits, which it reads as floats), json does: every line parses to what `json.loads` gives."""
    lines = [
        Document("a", "plain é 中文", "s", "web", "MIT", {"quality_score": 0.1234, "n": 2**63 - 1}).to_json_line(),
        b'{"id": "big", "text": "t", "metadata": {"n": 123456789012345678901234567890, "m": [-9223372036854775809]}}\n',
        b'{"id": "nan", "text": "t", "metadata": {"score": NaN, "inf": -Infinity}}\n',
        b'{"id": "surrogate", "text": "half \\ud800 a pair", "metadata": {}}\n',
        b'{"id": "last", "text": "no newline at the end"}',
    ]
    for compressed in (False, True):
        path = tmp_path / ("records.jsonl.zst" if compressed else "records.jsonl")
        with ShardWriter(path) as writer:
            for line in lines[:2]:
                writer.write_line(line)
            writer.write_line(b"\n")  # a blank line is no record
            for line in lines[2:]:
                writer.write_line(line)
        assert list(read_lines(path)) == [*lines[:-1], lines[-1] + b"\n"]
        expected = [json.loads(line) for line in lines]
        records = list(read_records(path))
        assert repr(records) == repr(expected)  # repr: NaN != NaN, and 1e29 == 10**29 would hide a float
        assert type(records[1]["metadata"]["n"]) is int and records[3]["text"] == "half \ud800 a pair"
    assert parse_line(lines[0]) == json.loads(lines[0]) and Document.from_line(lines[0]).metadata["n"] == 2**63 - 1


@settings(max_examples=200, deadline=None)
@given(metadata=st.dictionaries(st.text(), _JSON_VALUES))
def test_any_record_parses_as_json_parses_it(metadata: dict) -> None:
    line = json.dumps({"id": "x", "metadata": metadata}).encode()
    assert repr(parse_line(line)) == repr(json.loads(line))
