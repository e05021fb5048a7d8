"""What collect keeps of a user's records: every field (jsonl as parquet), a domain per record
(`domain_field`), uncompressed jsonl in S3 (moto's server), and WARC pages by their HTTP Content-Type."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from kiln.tasks.data.collect import CollectConfig, collect_documents
from kiln.tasks.data.inspection import accounting
from kiln.tasks.data.sources import SourceConfig
from tests.fixtures import shards

PROSE = (
    "The quick brown fox jumps over the lazy dog while the committee reviews the proposal in detail. "
    "Every paragraph of this page is written for a reader who wants to understand the subject well."
)


def _collect(tmp_path: Path, *sources) -> tuple[dict, Path]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    stats = collect_documents(CollectConfig(sources=list(sources)), out)
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    return stats, out



def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def test_jsonl_keeps_every_other_field_in_metadata_as_parquet_does(tmp_path):
    record = {"id": "a", "text": PROSE, "licence": "MIT", "lang": "en", "source": "forum dump 2024",
              "tags": ["faq", "howto"], "metadata": {"score": 0.5, "lang": "xx"}}
    (tmp_path / "r.jsonl").write_text(_jsonl([record]))
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "r.parquet")
    _, out = _collect(tmp_path, SourceConfig(name="j", path=str(tmp_path / "r.jsonl"), format="jsonl", domain="forum"),
                      SourceConfig(name="p", path=str(tmp_path / "r.parquet"), format="parquet", domain="forum"))
    jsonl, parquet = shards.records(out)
    # a field beside `metadata` wins over the same key inside it; the location is the reader's
    assert jsonl["metadata"] == {"score": 0.5, "lang": "en", "source": "forum dump 2024", "tags": ["faq", "howto"],
                                 "path": "r.jsonl", "line": 1}
    assert {k: v for k, v in parquet["metadata"].items() if k not in ("path", "row")} == \
           {k: v for k, v in jsonl["metadata"].items() if k not in ("path", "line")}
    assert jsonl["source"] == "j"  # the document's source is the collect source; the record's is metadata


def test_domain_field_gives_each_record_its_domain_with_the_source_domain_as_fallback(tmp_path):
    records = [
        {"id": 1, "text": PROSE, "licence": "MIT", "domain": "news"},
        {"id": 2, "text": PROSE, "licence": "MIT", "domain": "legal"},
        {"id": 3, "text": PROSE, "licence": "MIT"},  # no field: the source's domain
        {"id": 4, "text": PROSE, "licence": "MIT", "domain": None},
        {"id": 5, "text": PROSE, "licence": "MIT", "domain": "sports"},  # not declared: quarantined, whole
        {"id": 6, "text": PROSE, "licence": "MIT", "domain": ["news"]},
    ]
    (tmp_path / "r.jsonl").write_text(_jsonl(records))
    pq.write_table(pa.Table.from_pylist([{"text": PROSE, "id": "t", "licence": "MIT", "topic": "legal"}]),
                   tmp_path / "r.parquet")
    jsonl = SourceConfig(name="j", path=str(tmp_path / "r.jsonl"), format="jsonl", domain="misc",
                         domain_field="domain", domains=["news", "legal"])
    table = SourceConfig(name="p", path=str(tmp_path / "r.parquet"), format="parquet", domain="misc",
                         domain_field="topic", domains=["legal"])
    stats, out = _collect(tmp_path, jsonl, table)
    assert [(d["id"], d["domain"]) for d in shards.records(out)] == [
        ("j/1", "news"), ("j/2", "legal"), ("j/3", "misc"), ("j/4", "misc"), ("p/t", "legal")]
    assert stats["by_domain"] == {"legal": 2, "misc": 2, "news": 1}
    # the removals report counts each record under its own domain, as the shards read back say (issue 37)
    assert {d: row["kept"]["docs"] for d, row in stats["accounting"].items()} == {"legal": 2, "misc": 2, "news": 1}
    assert stats["accounting"] == accounting(out)
    quarantined = shards.records(out, "quarantine")
    assert [(q["reason"], q["line"]) for q in quarantined] == [("unknown_domain", 5), ("unknown_domain", 6)]
    assert "'sports', not one of the source's domains ['misc', 'news', 'legal']" in quarantined[0]["detail"]
    assert json.loads(quarantined[0]["raw"])["text"] == PROSE
    assert CollectConfig(sources=[jsonl, table]).domains() == ["misc", "news", "legal"]


def test_domain_field_needs_the_domains_it_may_take_and_domains_are_names():
    with pytest.raises(ValidationError, match="domain_field 'domain' needs `domains`"):
        SourceConfig(name="j", path="x", format="jsonl", domain="misc", domain_field="domain")
    with pytest.raises(ValidationError, match="set domain_field"):
        SourceConfig(name="j", path="x", format="jsonl", domain="misc", domains=["news"])
    with pytest.raises(ValidationError, match="domain_field"):  # a WARC record has no fields
        SourceConfig(name="w", path="x", format="warc", domain="misc", domain_field="domain", domains=["a"])
    with pytest.raises(ValidationError, match=r"domain names \['../up'\]"):  # a domain names a folder
        SourceConfig(name="j", path="x", format="jsonl", domain="misc", domain_field="d", domains=["../up"])


def test_uncompressed_jsonl_in_an_s3_bucket(tmp_path, s3):
    fs, options = s3
    records = [{"id": i, "text": f"{PROSE} {i}", "license": "MIT", "lang": "en"} for i in range(3)]
    fs.pipe("crawl/plain/posts.jsonl", _jsonl(records).encode() + b"x" * 300 + b"\n")
    source = SourceConfig(name="posts", path="s3://crawl/plain/posts.jsonl", format="jsonl", domain="forum",
                          storage_options=options)
    out = tmp_path / "out"
    out.mkdir()
    stats = collect_documents(CollectConfig(sources=[source], max_doc_bytes=250), out)
    docs = shards.records(out)
    assert [d["id"] for d in docs] == ["posts/0", "posts/1", "posts/2"] and docs[0]["metadata"]["lang"] == "en"
    assert stats["quarantined"] == {"too_large": 1}  # the line limit holds on a remote file too


def _warc(pages: list[tuple[str, bytes, str]]) -> bytes:
    """A WARC as warcio writes it: responses with HTTP headers and no WARC-Identified-Payload-Type."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    for url, body, content_type in pages:
        headers = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
        record = writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=headers)
        assert record.rec_headers.get_header("WARC-Identified-Payload-Type") is None
        writer.write_record(record)
    return buffer.getvalue()


def test_a_warc_response_is_html_when_its_http_content_type_says_so(tmp_path):
    fragment = f"<div class='post'><h1>Release notes</h1><p>{PROSE}</p><p>{PROSE}</p></div>".encode()
    plain = PROSE.encode()
    page = f"<!doctype html><html><body><article><p>{PROSE}</p></article></body></html>".encode()
    (tmp_path / "c").mkdir()
    (tmp_path / "c/a.warc.gz").write_bytes(_warc([
        ("https://example.org/notes", fragment, "text/html; charset=utf-8"),  # libmagic alone says text/plain
        ("https://example.org/notes.txt", plain, "text/plain"),
        ("https://example.org/mislabelled", page, "application/octet-stream"),  # the body is still sniffed
    ]))
    source = SourceConfig(name="crawl", path=str(tmp_path / "c"), format="warc", domain="pages", licence="CC-BY-4.0")
    stats, out = _collect(tmp_path, source)
    docs = shards.records(out)
    assert [d["metadata"]["url"] for d in docs] == ["https://example.org/notes", "https://example.org/mislabelled"]
    assert "Release notes" in docs[0]["text"]
    assert [(q["reason"], q["detail"]) for q in shards.records(out, "quarantine")] == [
        ("not_html", "payload text/plain (or an undecodable charset)")]
