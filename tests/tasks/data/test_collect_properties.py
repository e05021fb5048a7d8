"""No input can crash a data stage: random bytes, random JSON and mutated real records go through
every reader (jsonl plain, gzip and zstd; txt; html; parquet; WARC; code trees; Hugging Face
datasets), then clean and dedup; every stage accounts for every document.

Hypothesis draws the inputs; the example counts are small so the module runs in well under a
minute on two cores (collect alone is cheap and gets more examples than the three-stage chain).
"""

from __future__ import annotations

import gzip
import io
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.tasks.data.clean import CleanConfig, clean_documents
from kiln.tasks.data.collect import CollectConfig, collect_documents
from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.inspection import accounting
from kiln.tasks.data.shards import KINDS, shard_paths
from kiln.tasks.data.sources import SourceConfig
from tests.fixtures import shards

REPO = Path(__file__).resolve().parents[3]
REAL_LINES = (REPO / "data/sample/code/code.jsonl").read_bytes().splitlines()
QUALITY_MODEL = str(REPO / "data/models/quality_classifier.ftz")
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Any code point, lone surrogates included (Hypothesis leaves them out unless asked).
any_text = st.text(st.characters(exclude_categories=[]), max_size=40) | st.sampled_from(["a\ud800b", "\udfff", "\ud83d"])
real_words = st.sampled_from([w for w in REAL_LINES[0].decode().split() if w.isalpha()][:200])
prose = st.lists(real_words, min_size=0, max_size=80).map(" ".join)
licences = st.sampled_from([
    "MIT", "GPL-2+", "GPL-2.0+ or CC-BY-SA-3.0", "BSD-4-Clause-UC (fortune-mod; collected quotations)",
    "Frobnicate", "()", "", "Expat AND Vim", "PSF-2.0",
]) | any_text
numbers = st.integers() | st.integers(min_value=2**63, max_value=2**70) | st.floats()
json_values = st.recursive(
    st.none() | st.booleans() | numbers | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
records = st.fixed_dictionaries(
    {"text": st.one_of(prose, prose, any_text, json_values)},  # mostly text the stages can keep
    optional={"id": st.integers() | any_text | json_values, "licence": licences | json_values, "license": licences,
              "metadata": st.dictionaries(any_text, json_values, max_size=4) | json_values},
)


@st.composite
def json_lines(draw) -> bytes:
    """A record as JSON: escaped or raw UTF-8 (raw lone surrogates make invalid UTF-8, also input)."""
    text = json.dumps(draw(records), ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", errors="surrogatepass")


@st.composite
def mutated_real_lines(draw) -> bytes:
    """A real record of the sample corpus, with bytes inserted, deleted, replaced or cut off."""
    line = bytearray(draw(st.sampled_from(REAL_LINES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "cut", "escape"]))
        if kind == "insert":
            line[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del line[at:at + draw(st.integers(1, 20))]
        elif kind == "replace" and at < len(line):
            line[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del line[at:]
        else:  # a JSON escape that decodes to a lone surrogate, or a broken one
            line[at:at] = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\u", b"\\ud83d\\ude00"]))
    return bytes(line).replace(b"\n", b" ")


parser_limits = st.sampled_from([
    b"[" * 5000 + b"]" * 5000, b'{"text": "x", "n": ' + b"9" * 5000 + b"}", b'{"text": "x", "m": 1e999}',
    b'{"text": "x", "metadata": ' + b"[" * 70 + b"]" * 70 + b"}", b'{"text": "x", "m": NaN}', b"\xef\xbb\xbf{}",
])
lines = st.one_of(
    json_lines(), json_lines(), st.sampled_from(REAL_LINES), mutated_real_lines(), parser_limits,
    st.binary(max_size=120).map(lambda b: b.replace(b"\n", b"")),
)
html_pages = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from(["<html>", "<body>", "<p>", "</p>", "<script>x</script>", "<title>T</title>", "<svg>",
                              "<?xml version='1.0' encoding='latin1'?>", "&#xD800;", "\x00", "<div>" * 30])
             | prose, max_size=12).map(lambda parts: "".join(parts).encode()),
)


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """`data` as it is, cut off, or with a run of bytes overwritten (a bad disk block, a torn upload)."""
    kind = draw(st.sampled_from(["intact", "intact", "cut", "overwrite"]))
    if kind == "intact" or not data:
        return data
    at = draw(st.integers(0, len(data) - 1))
    if kind == "cut":
        return data[:at]
    return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at + 16:]


def _parquet(records: list[dict]) -> bytes:
    """Drawn records as a parquet table: text and licence columns as strings (or nulls), metadata as JSON text."""
    def string(value) -> str | None:
        return value.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace") if isinstance(value, str) else None

    columns = {"text": [string(r.get("text")) for r in records], "licence": [string(r.get("licence")) for r in records],
               "note": [json.dumps(r.get("metadata"), default=str) for r in records]}
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def _warc(pages: list[bytes]) -> bytes:
    """Pages as a WARC, byte for byte the same on every call (hypothesis replays draws)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    for i, page in enumerate(pages):
        headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html")], protocol="HTTP/1.1")
        fixed = {"WARC-Record-ID": f"<urn:uuid:00000000-0000-0000-0000-{i:012d}>", "WARC-Date": "2024-01-01T00:00:00Z"}
        writer.write_record(writer.create_warc_record(f"https://example.org/{i}", "response", payload=io.BytesIO(page),
                                                      http_headers=headers, warc_headers_dict=fixed))
    return buffer.getvalue()


code_names = st.sampled_from([
    "LICENSE", "COPYING", "a.py", "src/b.c", "vendor/c.js", "d_pb2.py", "e.png", "README", "sub/LICENSE", "sub/f.rs",
    "run", ".git/HEAD", "g.min.js",
])
code_files = st.one_of(st.binary(max_size=120), prose.map(str.encode), mutated_real_lines(),
                       st.sampled_from([b"#!/usr/bin/env python3\nprint(1)\n", b"/* SPDX-License-Identifier: MIT */\nint x;\n",
                                        b"# SPDX-License-Identifier: \xff(\n", b"// Code generated. DO NOT EDIT.\n"]))


@st.composite
def corpora(draw) -> dict[str, bytes]:
    """One file of each format collect reads from files, and a small code tree."""
    jsonl = b"\n".join(draw(st.lists(lines, min_size=1, max_size=12))) + draw(st.sampled_from([b"", b"\n"]))
    txt = draw(st.binary(max_size=200) | mutated_real_lines() | prose.map(str.encode))
    files = {"jsonl/a.jsonl": jsonl, "txt/a.txt": txt, "html/a.html": draw(html_pages)}
    files["jsonl/b.jsonl.gz"] = draw(damaged(gzip.compress(jsonl, mtime=0)) | st.binary(max_size=60))
    files["jsonl/c.jsonl.zst"] = draw(damaged(zstandard.ZstdCompressor().compress(jsonl)) | st.binary(max_size=60))
    files["parquet/a.parquet"] = draw(damaged(_parquet(draw(st.lists(records, max_size=6)))) | st.binary(max_size=200))
    files["warc/a.warc.gz"] = draw(damaged(_warc(draw(st.lists(html_pages, max_size=3)))) | st.binary(max_size=200))
    for name, data in draw(st.dictionaries(code_names, code_files, max_size=6)).items():
        files[f"code/{name}"] = data
    files.setdefault("code/placeholder.py", b"x = 1\n")
    return files


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _collect(root: Path, max_doc_bytes: int) -> tuple[dict, Path]:
    sources = [
        SourceConfig(name="j", path=str(root / "jsonl"), format="jsonl", domain="web", licence="MIT"),
        SourceConfig(name="t", path=str(root / "txt"), format="txt", domain="prose", licence="GPL-2+"),
        SourceConfig(name="h", path=str(root / "html"), format="html", domain="web", licence="CC-BY-4.0"),
        SourceConfig(name="p", path=str(root / "parquet"), format="parquet", domain="web", licence="MIT"),
        SourceConfig(name="w", path=str(root / "warc"), format="warc", domain="web", licence="MIT"),
        SourceConfig(name="c", path=str(root / "code"), format="code", domain="code"),
    ]
    out = root / "collect"
    out.mkdir()
    # small shards: most corpora span several
    stats = collect_documents(CollectConfig(sources=sources, max_doc_bytes=max_doc_bytes, shard_bytes=2000), out)
    _assert_accounts(stats, out)
    for record in shards.records(out, "quarantine"):
        assert record["reason"] and record["path"]  # a reason and a location, always
        assert "line" in record or record["source"] != "j"
        assert "offset" in record or record["source"] != "w"
    return stats, out


def _assert_accounts(stats: dict, out: Path) -> None:
    """Counts add up, the shards hold what the stats and listing say, and the removal report (tallied while
    writing) equals the shards read back."""
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    for kind, count in zip(KINDS, ("num_kept", "num_removed", "num_quarantined")):
        assert len(shards.lines(out, kind)) == stats[count] == sum(s["num_records"] for s in stats["shards"][kind])
    assert stats["accounting"] == accounting(out)


@pytest.mark.slow  # 150 fuzzed corpora through collect: ~15 s
@settings(max_examples=150, **SETTINGS)
@given(files=corpora(), max_doc_bytes=st.sampled_from([10_000_000, 300]))
def test_collect_turns_any_bytes_into_documents_or_quarantine(files, max_doc_bytes):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, files)
        stats, _ = _collect(root, max_doc_bytes)
        assert stats["num_in"] >= 3  # the txt, html and placeholder code files are one input each, whatever they hold


@settings(max_examples=12, **SETTINGS)
@given(rows=st.lists(records, max_size=5), damage=st.booleans(), data=st.data())
def test_a_saved_dataset_turns_into_documents_or_quarantine(rows, damage, data):
    """A `save_to_disk` folder read through `datasets`, its Arrow file intact or damaged."""
    import datasets

    columns = {"text": [r.get("text") if isinstance(r.get("text"), str) else None for r in rows],
               "license": [r.get("licence") if isinstance(r.get("licence"), str) else None for r in rows]}
    columns = {k: [v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") if v else v for v in vs]
               for k, vs in columns.items()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        datasets.Dataset.from_dict(columns, features=datasets.Features({"text": datasets.Value("string"),
                                                                        "license": datasets.Value("string")})
                                   ).save_to_disk(str(root / "ds"))
        for arrow in (root / "ds").glob("*.arrow") if damage else ():  # an empty dataset has none
            arrow.write_bytes(data.draw(damaged(arrow.read_bytes()) | st.binary(max_size=100)))
        out = root / "collect"
        out.mkdir()
        source = SourceConfig(name="d", path=str(root / "ds"), format="hf", domain="web")
        stats = collect_documents(CollectConfig(sources=[source]), out)
        _assert_accounts(stats, out)
        assert stats["num_in"] >= (0 if damage else len(rows))


@pytest.mark.slow  # 20 fuzzed corpora through collect, clean and dedup: ~12 s
@settings(max_examples=20, **SETTINGS)
@given(files=corpora())
def test_collect_clean_and_dedup_account_for_every_document(files):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, files)
        collected, collect_out = _collect(root, 10_000_000)
        (root / "clean").mkdir()
        cleaned = clean_documents(CleanConfig(quality_model=QUALITY_MODEL), collect_out, root / "clean")
        _assert_accounts(cleaned, root / "clean")
        assert cleaned["num_in"] == collected["num_kept"]
        (root / "dedup").mkdir()
        deduped = dedup_documents(DedupConfig(), shard_paths(root / "clean"), root / "dedup")
        _assert_accounts(deduped, root / "dedup")
        assert deduped["num_in"] == cleaned["num_kept"]
