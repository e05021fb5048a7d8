"""Collect's source formats: WARC, parquet, compressed jsonl, Hugging Face datasets, code trees,
globs, file:// URLs and an S3 bucket (moto's server on loopback); weights and the typed entries."""

from __future__ import annotations

import gzip
import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from identify.vendor.licenses import LICENSES
from pydantic import ValidationError

from kiln.tasks.data.code_tree import language_of, licence_id, skip_reason, spdx_header
from kiln.tasks.data.collect import CollectConfig, collect_documents, source_paths
from kiln.tasks.data.sources import SourceConfig
from kiln.tasks.errors import ConfigError
from tests.fixtures import shards

REPO = Path(__file__).resolve().parents[3]
TEXTS = dict(LICENSES)
PROSE = (
    "The quick brown fox jumps over the lazy dog while the committee reviews the proposal in detail. "
    "Every paragraph of this page is written for a reader who wants to understand the subject well."
)


def _collect(tmp_path: Path, *sources, **extra) -> tuple[dict, Path]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    stats = collect_documents(CollectConfig(sources=list(sources), **extra), out)
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    return stats, out



# --- WARC -----------------------------------------------------------------------------------------


def warc_bytes(pages: list[tuple[str, bytes, str]], date: str = "2024-03-01T12:00:00Z") -> bytes:
    """A gzipped WARC as a crawler writes it: warcinfo, then a request and a response per URL."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    writer.write_record(writer.create_warcinfo_record("t.warc.gz", {"software": "test"}))
    for url, body, content_type in pages:
        request = writer.create_warc_record(url, "request", payload=io.BytesIO(b""), warc_headers_dict={"WARC-Date": date},
                                            http_headers=StatusAndHeaders("GET / HTTP/1.1", [], is_http_request=True))
        headers = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
        response = writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=headers,
                                             warc_headers_dict={"WARC-Date": date})
        writer.write_record(request)
        writer.write_record(response)
    return buffer.getvalue()


def _record_offsets(data: bytes) -> list[int]:
    from warcio.archiveiterator import ArchiveIterator

    records = ArchiveIterator(io.BytesIO(data))
    return [records.offset for _ in records]


def _page(title: str, body: str) -> str:
    return f"<html><head><title>{title}</title></head><body><nav>Home | About</nav><article><h1>{title}</h1>" \
           f"<p>{body}</p><p>{body}</p></article></body></html>"


def test_warc_records_become_documents_with_url_and_crawl_date_and_offsets(tmp_path):
    latin1 = _page("Café", PROSE + " Le café est très bon à Genève.").encode("latin-1")
    pages = [
        ("https://example.org/a", _page("Alpha", PROSE).encode(), "text/html; charset=utf-8"),
        ("https://example.org/b", latin1, "text/html"),  # no charset: datatrove detects it
        ("https://example.org/logo.png", b"\x89PNG\r\n\x1a\n" + bytes(200), "image/png"),
        ("https://example.org/big", _page("Big", PROSE * 40).encode(), "text/html"),
    ]
    data = warc_bytes(pages)
    (tmp_path / "crawl").mkdir()
    (tmp_path / "crawl/a.warc.gz").write_bytes(data)
    damaged = bytearray(warc_bytes(pages))
    response = _record_offsets(bytes(damaged))[2]  # warcinfo, request, then the first response
    damaged[response + 40: response + 90] = b"\xff" * 50  # a damaged disk block inside it
    (tmp_path / "crawl/b.warc.gz").write_bytes(bytes(damaged))
    source = SourceConfig(name="crawl", path=str(tmp_path / "crawl"), format="warc", domain="web", licence="CC-BY-4.0")
    stats, out = _collect(tmp_path, source, max_doc_bytes=5_000)

    docs = shards.records(out)
    assert [d["metadata"]["url"] for d in docs][:2] == ["https://example.org/a", "https://example.org/b"]
    assert {d["metadata"]["crawl_date"] for d in docs} == {"2024-03-01T12:00:00Z"}
    assert docs[0]["id"].startswith("crawl/urn:uuid:") and "Alpha" in docs[0]["text"] and "Home | About" not in docs[0]["text"]
    assert "Le café est très bon" in docs[1]["text"]
    quarantine = shards.records(out, "quarantine")
    assert [(q["reason"], q["path"]) for q in quarantine[:2]] == [("not_html", "a.warc.gz"), ("too_large", "a.warc.gz")]
    offsets = [q["offset"] for q in quarantine]
    assert 0 < docs[0]["metadata"]["offset"] < docs[1]["metadata"]["offset"] < offsets[0] < offsets[1] < len(data)
    broken = [q for q in quarantine if q["path"] == "b.warc.gz"]
    assert broken[0]["reason"] in ("corrupt_warc", "unreadable_warc_record") and broken[0]["offset"] == response
    with open(tmp_path / "crawl/a.warc.gz", "rb") as handle:  # the offset is where the record's gzip member starts
        handle.seek(docs[0]["metadata"]["offset"])
        assert gzip.GzipFile(fileobj=handle).read(9) == b"WARC/1.0\r"
    assert stats["by_format"] == {"warc": len(docs)} and "https://example.org/a" not in [d["metadata"]["url"] for d in docs[2:]]


def test_the_bundled_warc_sample(tmp_path):
    source = SourceConfig(name="howto", path=str(REPO / "data/sample/warc"), format="warc", domain="web", licence="PSF-2.0")
    stats, out = _collect(tmp_path, source)
    assert stats["num_kept"] == 6 and stats["quarantined"] == {"not_html": 1}
    urls = [d["metadata"]["url"] for d in shards.records(out)]
    assert urls[0] == "https://docs.python.org/3.11/howto/annotations.html"


# --- parquet and compressed jsonl -------------------------------------------------------------------


def test_parquet_rows_go_through_the_record_checks(tmp_path):
    rows = [
        {"id": "a", "text": PROSE, "licence": "MIT", "license": None, "url": "https://a", "score": 0.5},
        {"id": "b", "text": PROSE + " b", "licence": None, "license": "GPL-2+", "url": None, "score": 1.0},
        {"id": "c", "text": None, "licence": "MIT", "license": None, "url": None, "score": 2.0},  # missing_text
        {"id": "d", "text": PROSE + " d", "licence": "MIT", "license": None, "url": None, "score": math.nan},
    ]
    (tmp_path / "t").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t/part-0.parquet")
    (tmp_path / "t/part-1.parquet").write_bytes(b"PAR1 not really parquet")
    source = SourceConfig(name="t", path=str(tmp_path / "t"), format="parquet", domain="web")
    stats, out = _collect(tmp_path, source)

    docs = shards.records(out)
    assert [(d["id"], d["licence"]) for d in docs] == [("t/a", "MIT"), ("t/b", "GPL-2.0-or-later")]
    assert docs[0]["metadata"] == {"url": "https://a", "score": 0.5, "path": "part-0.parquet", "row": 0}
    assert [(q["reason"], q["path"], q.get("row")) for q in shards.records(out, "quarantine")] == [
        ("missing_text", "part-0.parquet", 2), ("invalid_json", "part-0.parquet", 3), ("unreadable_parquet", "part-1.parquet", None),
    ]
    assert stats["num_in"] == 5


def test_parquet_columns_pick_what_is_read(tmp_path):
    table = pa.table({"content": [PROSE], "blob": [b"\x00\x01"], "doc": ["x"], "licence": ["MIT"]})
    pq.write_table(table, tmp_path / "t.parquet")
    base = dict(name="t", path=str(tmp_path / "t.parquet"), format="parquet", domain="web", text_column="content", id_column="doc")
    stats, out = _collect(tmp_path, SourceConfig(**base))
    assert stats["quarantined"] == {"unsupported_value": 1}  # bytes have no JSON form
    stats, out = _collect(tmp_path, SourceConfig(**base, columns=["content", "doc", "licence"]))
    assert [d["id"] for d in shards.records(out)] == ["t/x"]


def test_gzip_and_zstd_jsonl_are_streamed_and_a_cut_stream_is_quarantined_at_its_line(tmp_path):
    def data(first: int) -> bytes:
        lines = [json.dumps({"id": i, "text": f"{PROSE} {i}", "license": "MIT"}) for i in range(first, first + 50)]
        return ("\n".join(lines) + "\n").encode()

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(data(0)))
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data(100)))
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(data(200))[:-30])  # cut off: the last bytes and the crc are gone
    (folder / "d.jsonl").write_bytes(data(300))
    stats, out = _collect(tmp_path, SourceConfig(name="c", path=str(folder), format="jsonl", domain="web"))
    ids = [d["id"] for d in shards.records(out)]
    assert ids[:100] == [f"c/{i}" for i in range(50)] + [f"c/{i}" for i in range(100, 150)]
    assert ids[-50:] == [f"c/{i}" for i in range(300, 350)] and 150 < len(ids) < 200
    assert [(q["reason"], q["path"], q["line"]) for q in shards.records(out, "quarantine")] == [
        ("corrupt_file", "c.jsonl.gz", len(ids) - 150 + 1)]  # the line after the last one read


# --- Hugging Face datasets ---------------------------------------------------------------------------


def test_a_dataset_saved_to_disk_is_read_by_datasets(tmp_path):
    import datasets

    rows = {"text": [PROSE, PROSE + " two"], "id": ["one", "two"], "license": ["Apache-2.0", "MIT"], "lang": ["en", "en"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "ds"))
    source = SourceConfig(name="ds", path=str(tmp_path / "ds"), format="hf", domain="web")
    stats, out = _collect(tmp_path, source)
    docs = shards.records(out)
    assert [(d["id"], d["licence"], d["metadata"]["lang"], d["metadata"]["split"]) for d in docs] == [
        ("ds/one", "Apache-2.0", "en", "train"), ("ds/two", "MIT", "en", "train")]
    stats, out = _collect(tmp_path, SourceConfig(name="ds", path=str(tmp_path / "ds"), format="hf", domain="web", split="test"))
    assert stats["quarantined"] == {"unreadable_dataset": 1}  # no such split


def test_load_dataset_builds_a_local_folder_and_a_builder_with_data_files(tmp_path):
    folder = tmp_path / "hub-style" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"content": [PROSE, PROSE + " 2"], "licence": ["MIT", "MIT"]}), folder / "train-00000.parquet")
    by_folder = SourceConfig(name="folder", path=str(tmp_path / "hub-style"), format="hf", domain="web", text_column="content")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"text": PROSE + " j", "licence": "CC0-1.0", "id": 7}) + "\n")
    by_builder = SourceConfig(name="builder", path="json", format="hf", domain="web", data_files=str(jsonl))
    stats, out = _collect(tmp_path, by_folder, by_builder)
    assert stats["by_source"] == {"folder": 2, "builder": 1}
    assert [d["id"] for d in shards.records(out)] == [f"folder/{tmp_path / 'hub-style'}:0",
                                                                 f"folder/{tmp_path / 'hub-style'}:1", "builder/7"]


def test_the_bundled_dataset_sample(tmp_path):
    source = SourceConfig(name="rel", path=str(REPO / "data/sample/hf/git-relnotes"), format="hf", domain="prose")
    stats, _ = _collect(tmp_path, source)
    assert stats["num_kept"] == 16 and stats["num_quarantined"] == 0


# --- code trees -----------------------------------------------------------------------------------


def _tree(root: Path) -> Path:
    files = {
        "LICENSE": TEXTS["MIT"].replace("[year] [fullname]", "2024 Jane Doe"),
        "src/app.py": "import sys\n\n\ndef main() -> int:\n    return len(sys.argv)\n",
        "src/fast.c": "/* SPDX-License-Identifier: Apache-2.0 */\nint add(int a, int b) { return a + b; }\n",
        "src/api_pb2.py": "# protobuf output\nDESCRIPTOR = None\n",
        "src/table.h": "/* Code generated by gen.py. DO NOT EDIT. */\nint table[3] = {1, 2, 3};\n",
        "vendor/left_pad.js": "module.exports = function (s) { return s; };\n",
        "bin/tool": "#!/usr/bin/env python3\nprint('hello')\n",
        "README": "Nothing here is code.\n",
        "gpl/COPYING": TEXTS["GPL-3.0"],
        "gpl/lib.py": "def f():\n    return 1\n",
        "odd/LICENSE": "You may do what you like, but do not blame me.\n",
        "odd/x.py": "X = 1\n",
        "docs/conf.py": "project = 'demo'\n",
        ".git/config": "[core]\n",
        "latin1.py": "# caf\xe9\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode("latin-1" if rel == "latin1.py" else "utf-8"))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (root / "src/blob.py").write_bytes(b"x = 1\x00\x00\x00")
    return root


def test_a_code_tree_is_one_document_per_source_file_with_language_and_licence(tmp_path):
    tree = _tree(tmp_path / "repo")
    source = SourceConfig(name="repo", path=str(tree), format="code", domain="code", exclude=["docs/**"])
    stats, out = _collect(tmp_path, source)
    docs = {d["metadata"]["path"]: d for d in shards.records(out)}
    assert {path: (d["metadata"]["language"], d["licence"], d["metadata"]["licence_origin"]) for path, d in docs.items()} == {
        "bin/tool": ("python", "MIT", "LICENSE"),
        "gpl/lib.py": ("python", "GPL-3.0-only", "gpl/COPYING"),
        "src/app.py": ("python", "MIT", "LICENSE"),
        "src/fast.c": ("c", "Apache-2.0", "spdx_header"),
    }
    assert docs["src/app.py"]["id"] == "repo/src/app.py"
    removed = {r["path"]: r["reason"] for r in shards.records(out, "removed")}
    assert removed == {
        "LICENSE": "licence_file", "README": "not_code", "docs/conf.py": "excluded", "gpl/COPYING": "licence_file",
        "logo.png": "binary", "odd/LICENSE": "licence_file", "src/api_pb2.py": "generated", "src/blob.py": "binary",
        "src/table.h": "generated", "vendor/left_pad.js": "vendored",
    }
    quarantine = {q["path"]: (q["reason"], q.get("detail", "")) for q in shards.records(out, "quarantine")}
    assert quarantine["latin1.py"][0] == "non_utf8"
    assert quarantine["odd/x.py"] == ("missing_licence", "licence file odd/LICENSE is not a licence text identify recognises")
    assert ".git/config" not in quarantine | removed | docs

    # a source licence answers where the tree's files do not
    stats, out = _collect(tmp_path, SourceConfig(name="repo", path=str(tree), format="code", domain="code", licence="ISC"))
    assert {d["metadata"]["path"]: d["licence"] for d in shards.records(out)}["odd/x.py"] == "ISC"


def test_code_rules_one_by_one():
    assert language_of("a/b.h", b"") == "c" and language_of("x.hpp", b"") == "c++" and language_of("t.pyi", b"") == "python"
    assert language_of("run", b"#!/bin/sh\necho") == "shell" and language_of("notes.txt", b"") is None
    assert language_of("pic.svg", b"<svg/>") is None and language_of("Makefile", b"") == "makefile"
    assert skip_reason("third_party/zlib/inflate.c", b"") == ("vendored", "under third_party/")
    assert skip_reason("web/app.min.js", b"")[0] == "generated" and skip_reason("ok.py", b"# fine\n") is None
    assert skip_reason("x.go", b"// Code generated by protoc-gen-go. DO NOT EDIT.\n")[0] == "generated"
    assert spdx_header(b"# SPDX-License-Identifier: GPL-2.0-or-later OR MIT\n") == "GPL-2.0-or-later OR MIT"
    assert spdx_header(b"<!-- SPDX-License-Identifier: CC-BY-4.0 -->\n") == "CC-BY-4.0"
    assert licence_id(TEXTS["Apache-2.0"]) == "Apache-2.0" and licence_id("Do what you want.") is None
    wrapped = (REPO / "data/sample/code-tree/colorlog/LICENSE").read_text()  # "COPYRIGHT HOLDERS" starts a line
    assert licence_id(wrapped) == "MIT"


def test_the_bundled_code_tree(tmp_path):
    source = SourceConfig(name="colorlog", path=str(REPO / "data/sample/code-tree/colorlog"), format="code", domain="code")
    stats, out = _collect(tmp_path, source)
    assert stats["num_kept"] == 4 and stats["removed"] == {"binary": 1, "licence_file": 1, "not_code": 1}
    assert {d["licence"] for d in shards.records(out)} == {"MIT"}


# --- where files are: globs, file:// and S3 -------------------------------------------------------------


def test_globs_and_file_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d/sub").mkdir(parents=True)
    for name in ("d/a.jsonl", "d/sub/b.jsonl", "d/c.txt"):
        (tmp_path / name).write_text(json.dumps({"text": PROSE, "id": name, "licence": "MIT"}) + "\n")
    by_glob = SourceConfig(name="g", path="d/*.jsonl", format="jsonl", domain="web")
    by_url = SourceConfig(name="u", path=f"file://{tmp_path}/d", format="jsonl", domain="web")
    stats, out = _collect(tmp_path, by_glob, by_url)
    assert [d["id"] for d in shards.records(out)] == ["g/d/a.jsonl", "u/d/a.jsonl", "u/d/sub/b.jsonl"]
    assert source_paths(CollectConfig(sources=[by_glob, by_url])) == [Path("d"), tmp_path / "d"]


def test_sources_in_an_s3_bucket(tmp_path, s3):
    fs, options = s3
    fs.pipe("crawl/2024/a.warc.gz", warc_bytes([("https://example.org/a", _page("Alpha", PROSE).encode(), "text/html")]))
    fs.pipe("crawl/dump/part-0.jsonl.zst", zstandard.ZstdCompressor().compress(
        (json.dumps({"text": PROSE, "licence": "MIT"}) + "\n").encode()))
    table = io.BytesIO()
    pq.write_table(pa.table({"text": [PROSE], "licence": ["CC0-1.0"]}), table)
    fs.pipe("crawl/tables/t.parquet", table.getvalue())
    sources = [
        SourceConfig(name="warc", path="s3://crawl/2024", format="warc", domain="web", licence="MIT", storage_options=options),
        SourceConfig(name="dump", path="s3://crawl/dump/*.jsonl.zst", format="jsonl", domain="web", storage_options=options),
        SourceConfig(name="tables", path="s3://crawl/tables/", format="parquet", domain="web", storage_options=options),
    ]
    stats, out = _collect(tmp_path, *sources)
    assert stats["by_source"] == {"warc": 1, "dump": 1, "tables": 1}
    assert shards.records(out)[0]["metadata"]["url"] == "https://example.org/a"

    cfg = CollectConfig(sources=sources)
    before = cfg.identity()["remote_sources_sha256"]
    assert source_paths(cfg) == [] and set(before) == {"warc", "dump", "tables"}
    fs.pipe("crawl/dump/part-0.jsonl.zst", zstandard.ZstdCompressor().compress(b'{"text": "new", "licence": "MIT"}\n'))
    after = CollectConfig(sources=sources).identity()["remote_sources_sha256"]
    assert after["dump"] != before["dump"] and after["warc"] == before["warc"]  # a rewritten object moves the key


# --- the entries themselves --------------------------------------------------------------------------------


def test_weight_keeps_the_same_share_on_every_run(tmp_path):
    (tmp_path / "w.jsonl").write_text("".join(json.dumps({"id": i, "text": PROSE, "licence": "MIT"}) + "\n" for i in range(400)))
    source = SourceConfig(name="w", path=str(tmp_path / "w.jsonl"), format="jsonl", domain="web", weight=0.25)
    first, out = _collect(tmp_path, source)
    kept = [d["id"] for d in shards.records(out)]
    second, _ = _collect(tmp_path, source)
    assert 70 <= first["num_kept"] <= 130 and first["removed"] == {"sampled_out": 400 - first["num_kept"]}
    assert [d["id"] for d in shards.records(out)] == kept and second == first


def test_each_format_takes_its_own_fields(tmp_path):
    with pytest.raises(ValidationError, match="text_column"):
        SourceConfig(name="j", path="x", format="jsonl", domain="web", text_column="body")
    with pytest.raises(ValidationError, match="format"):
        SourceConfig(name="j", path="x", format="csv", domain="web")
    with pytest.raises(ValidationError, match="weight"):
        SourceConfig(name="j", path="x", format="jsonl", domain="web", weight=2)
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError, match=r"collect.sources\[0\].licence: source 'w' is warc"):
        collect_documents(CollectConfig(sources=[SourceConfig(name="w", path=str(tmp_path / "c"), format="warc", domain="web")]),
                          tmp_path)
