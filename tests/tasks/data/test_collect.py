"""Collecting local sources: every record kept, removed for its licence, or quarantined with file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.data.collect import CollectConfig, collect_documents, source_paths
from kiln.tasks.data.sources import SourceConfig
from kiln.tasks.errors import ConfigError, InputError
from tests.fixtures import shards

# Real text: the MIT licence and paragraphs of the GNU GPL v3 preamble.
MIT_GRANT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
    "associated documentation files (the \"Software\"), to deal in the Software without restriction, "
    "including without limitation the rights to use, copy, modify, merge, publish, distribute, "
    "sublicense, and/or sell copies of the Software."
)
MIT_NOTICE = (
    "The above copyright notice and this permission notice shall be included in all copies or "
    "substantial portions of the Software."
)
GPL_INTRO = "The GNU General Public License is a free, copyleft license for software and other kinds of works."
GPL_PATENTS = (
    "Finally, every program is threatened constantly by software patents. States should not allow "
    "patents to restrict development and use of software on general-purpose computers."
)
PAGE = f"""<!DOCTYPE html>
<html><head><title>GNU General Public License</title>
<link rel="canonical" href="https://www.gnu.org/licenses/gpl-3.0.html">
<script>var tracker = "do not keep me";</script></head>
<body><nav><a href="/">Home</a> | <a href="/licenses">Licenses</a></nav>
<article><h1>Preamble</h1><p>{GPL_INTRO}</p><p>{GPL_PATENTS}</p></article>
</body></html>
"""



def _code_source(root: Path) -> Path:
    """A jsonl source with one record of every kind of problem, and two good files."""
    folder = root / "code"
    (folder / "b").mkdir(parents=True)
    lines = [
        json.dumps({"text": MIT_GRANT, "licence": "MIT", "metadata": {"repo": "x/y"}}),  # 1 kept
        json.dumps({"id": "notice", "text": MIT_NOTICE, "licence": "MIT"}),  # 2 kept, own id
        "{not json",  # 3 invalid_json
        json.dumps([MIT_GRANT]),  # 4 not_an_object
        json.dumps({"body": MIT_GRANT, "licence": "MIT"}),  # 5 missing_text
        json.dumps({"text": MIT_NOTICE}),  # 6 missing_licence
        json.dumps({"text": "   \n", "licence": "MIT"}),  # 7 empty_text
        json.dumps({"text": GPL_INTRO, "licence": "BSD-4-Clause"}),  # 8 licence_not_allowed
        "",  # a blank line is not a record
    ]
    data = ("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9", "licence": "MIT"}\n'  # 10 non_utf8
    (folder / "a.jsonl").write_bytes(data)
    (folder / "b" / "c.jsonl").write_text(json.dumps({"text": GPL_PATENTS, "licence": "GPL-3.0-only"}) + "\n")
    (folder / "README.md").write_text("not matched by the glob")
    return folder


def _config(**extra) -> CollectConfig:
    return CollectConfig(
        sources=[
            SourceConfig(name="code", path="data/code", format="jsonl", domain="code"),
            SourceConfig(name="prose", path="data/prose", format="txt", domain="prose", licence="CC-BY-4.0"),
            SourceConfig(name="web", path="data/web", format="html", domain="web", licence="GPL-3.0-or-later"),
        ],
        **extra,
    )


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    """Three sources under `tmp_path/data`, with the working directory at `tmp_path`."""
    monkeypatch.chdir(tmp_path)
    _code_source(tmp_path / "data")
    prose = tmp_path / "data" / "prose"
    prose.mkdir()
    (prose / "mit.txt").write_text(f"{MIT_GRANT}\n\n{MIT_NOTICE}\n")
    (prose / "gpl.txt").write_text(GPL_INTRO + "\n")
    (prose / "latin1.txt").write_bytes(GPL_PATENTS.encode() + b" \xa9 2007\n")
    web = tmp_path / "data" / "web" / "gnu"
    web.mkdir(parents=True)
    (web / "gpl.html").write_text(PAGE)
    (web / "blank.html").write_text("<html><body><script>var x = 1;</script></body></html>")
    out = tmp_path / "out"
    out.mkdir()
    return out


def test_every_record_is_kept_removed_or_quarantined_with_its_location(corpus):
    stats = collect_documents(_config(), corpus)
    assert stats["num_in"] == 15
    assert (stats["num_kept"], stats["num_removed"], stats["num_quarantined"]) == (6, 1, 8)
    assert stats["removed"] == {"licence_not_allowed:BSD-4-Clause": 1}
    assert stats["quarantined"] == {
        "empty_text": 2,
        "invalid_json": 1,
        "missing_licence": 1,
        "missing_text": 1,
        "non_utf8": 2,
        "not_an_object": 1,
    }
    assert stats["by_source"] == {"code": 3, "prose": 2, "web": 1}
    assert stats["by_domain"] == {"code": 3, "prose": 2, "web": 1}

    quarantine = [(q["reason"], q["source"], q["path"], q.get("line")) for q in shards.records(corpus, "quarantine")]
    assert quarantine == [
        ("invalid_json", "code", "a.jsonl", 3),
        ("not_an_object", "code", "a.jsonl", 4),
        ("missing_text", "code", "a.jsonl", 5),
        ("missing_licence", "code", "a.jsonl", 6),
        ("empty_text", "code", "a.jsonl", 7),
        ("non_utf8", "code", "a.jsonl", 10),
        ("non_utf8", "prose", "latin1.txt", None),
        ("empty_text", "web", "gnu/blank.html", None),
    ]
    # The unparsed input travels with the reason, so nothing is lost.
    assert shards.records(corpus, "quarantine")[0]["raw"] == "{not json\n"
    assert shards.records(corpus, "quarantine")[5]["raw"] == '{"text": "caf\\xe9", "licence": "MIT"}\n'

    [removed] = shards.records(corpus, "removed")
    assert (removed["reason"], removed["path"], removed["line"]) == ("licence_not_allowed:BSD-4-Clause", "a.jsonl", 8)
    assert removed["document"]["text"] == GPL_INTRO


def test_documents_have_stable_ids_text_and_provenance(corpus):
    stats = collect_documents(_config(), corpus)
    docs = shards.records(corpus)
    assert [d["id"] for d in docs] == [
        "code/a.jsonl:1",
        "code/notice",
        "code/b/c.jsonl:1",
        "prose/gpl.txt",
        "prose/mit.txt",
        "web/gnu/gpl.html",
    ]
    assert [d["licence"] for d in docs] == ["MIT", "MIT", "GPL-3.0-only", "CC-BY-4.0", "CC-BY-4.0", "GPL-3.0-or-later"]
    assert docs[0]["metadata"] == {"repo": "x/y", "path": "a.jsonl", "line": 1}
    assert docs[4]["text"] == f"{MIT_GRANT}\n\n{MIT_NOTICE}\n"
    assert stats["num_chars"] == sum(len(d["text"]) for d in docs)

    page = docs[5]
    assert page["metadata"]["title"] == "Preamble"  # trafilatura prefers the page's heading
    assert page["text"].startswith("Preamble\n")
    assert GPL_INTRO in page["text"] and GPL_PATENTS in page["text"]
    assert "tracker" not in page["text"]
    assert page["metadata"]["url"] == "https://www.gnu.org/licenses/gpl-3.0.html"
    assert page["metadata"]["path"] == "gnu/gpl.html"

    # A rerun writes byte-identical output.
    again = corpus.parent / "again"
    again.mkdir()
    collect_documents(_config(), again)
    assert shards.raw(again) == shards.raw(corpus)


def test_compliance_report_lists_licences_per_source(corpus):
    collect_documents(_config(), corpus)
    compliance = json.loads((corpus / "compliance.json").read_text())
    code = compliance["sources"][0]
    assert code["licences"] == {
        "GPL-3.0-only": {"status": "allowed", "allowed": True, "num_docs": 1, "as_written": {"GPL-3.0-only": 1}},
        "MIT": {"status": "allowed", "allowed": True, "num_docs": 2, "as_written": {"MIT": 2}},
        "BSD-4-Clause": {"status": "not_allowed", "allowed": False, "num_docs": 1, "as_written": {"BSD-4-Clause": 1}},
    }
    assert (code["num_files"], code["num_kept"], code["num_removed"], code["num_quarantined"]) == (2, 3, 1, 6)
    markdown = (corpus / "compliance.md").read_text()
    seen = "BSD-4-Clause (NOT allowed, 1), GPL-3.0-only (allowed, 1), MIT (allowed, 2)"
    assert f"| code | `data/code` | {seen} | 3 | 1 | 6 |" in markdown


def test_cap_keeps_the_first_documents_of_each_source(corpus):
    stats = collect_documents(_config(max_docs_per_source=1), corpus)
    assert stats["by_source"] == {"code": 1, "prose": 1, "web": 1}
    ids = [d["id"] for d in shards.records(corpus)]
    assert ids == ["code/a.jsonl:1", "prose/gpl.txt", "web/gnu/gpl.html"]
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]


def test_licence_allowlist_and_min_chars_are_applied(corpus):
    assert (len(MIT_NOTICE), len(GPL_INTRO)) == (126, 97)
    stats = collect_documents(_config(allowed_licences=["MIT"], min_chars=130), corpus)
    assert stats["by_source"] == {"code": 1, "prose": 0, "web": 0}
    assert stats["removed"] == {
        "licence_not_allowed:CC-BY-4.0": 1,
        "licence_not_allowed:GPL-3.0-only": 1,
        "licence_not_allowed:GPL-3.0-or-later": 1,
    }
    # Too short, whatever the licence: MIT_NOTICE, the blank record, GPL_INTRO (twice), the blank page.
    assert stats["quarantined"]["empty_text"] == 5


def test_missing_source_path_names_the_source_and_the_key(corpus):
    cfg = CollectConfig(
        sources=[
            SourceConfig(name="code", path="data/code", format="jsonl", domain="code"),
            SourceConfig(name="books", path="data/books", format="txt", domain="prose", licence="CC0-1.0"),
        ]
    )
    with pytest.raises(InputError) as err:
        collect_documents(cfg, corpus)
    assert "'books'" in str(err.value) and "'data/books'" in str(err.value)
    assert "collect.sources[1].path" in str(err.value)
    assert list(corpus.iterdir()) == []  # nothing written
    assert source_paths(cfg) == [Path("data/code"), Path("data/books")]


def test_bad_source_configs_are_config_errors(corpus):
    twice = SourceConfig(name="code", path="data/code", format="jsonl", domain="code")
    with pytest.raises(ConfigError, match=r"collect.sources\[1\].name"):
        collect_documents(CollectConfig(sources=[twice, twice]), corpus)
    unlicensed = SourceConfig(name="prose", path="data/prose", format="txt", domain="prose")
    with pytest.raises(ConfigError, match=r"collect.sources\[0\].licence"):
        collect_documents(CollectConfig(sources=[unlicensed]), corpus)
    assert list(corpus.iterdir()) == []


def test_duplicate_record_ids_are_quarantined(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = [{"id": 7, "text": MIT_GRANT}, {"id": "7", "text": MIT_NOTICE}]
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = SourceConfig(name="s", path="one.jsonl", format="jsonl", domain="code", licence="MIT")
    cfg = CollectConfig(sources=[source])
    (tmp_path / "out").mkdir()
    stats = collect_documents(cfg, tmp_path / "out")
    assert (stats["num_kept"], stats["quarantined"]) == (1, {"duplicate_id": 1})
    [bad] = shards.records(tmp_path / "out", "quarantine")
    assert (bad["path"], bad["line"]) == ("one.jsonl", 2) and "'s/7'" in bad["detail"]


def _collect_one(tmp_path: Path, lines: list[str], **extra) -> tuple[dict, Path]:
    """Collect one jsonl file of `lines` (records without a licence get MIT from the source)."""
    (tmp_path / "in.jsonl").write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    source = SourceConfig(name="s", path=str(tmp_path / "in.jsonl"), format="jsonl", domain="code", licence="MIT")
    out = tmp_path / "out"
    out.mkdir()
    return collect_documents(CollectConfig(sources=[source], **extra), out), out


def test_lines_that_used_to_kill_the_stage_are_repaired_or_quarantined_with_their_line(tmp_path):
    lines = [
        json.dumps({"text": f"{MIT_GRANT} \ud800", "metadata": {"note\udfff": "\ud83d"}}),  # 1 repaired, kept
        '{"text": "a big number", "n": ' + "9" * 5000 + "}",  # 2 past Python's 4300-digit limit
        "[" * 100_000 + "]" * 100_000,  # 3 past Python's nesting limit (RecursionError)
        json.dumps({"text": MIT_NOTICE, "metadata": {"score": 10**30}}),  # 4 past 64 bits (the later stages)
        '{"text": "not a number", "metadata": {"score": NaN}}',  # 5 not JSON
        "\x0c",  # 6 a form feed is not a blank line
    ]
    stats, out = _collect_one(tmp_path, lines)
    assert (stats["num_in"], stats["num_kept"], stats["num_repaired"]) == (6, 1, 1)
    assert stats["quarantined"] == {"invalid_json": 2, "json_number_out_of_range": 2, "json_too_deep": 1}
    assert [(q["reason"], q["path"], q["line"]) for q in shards.records(out, "quarantine")] == [
        ("json_number_out_of_range", "in.jsonl", 2), ("json_too_deep", "in.jsonl", 3),
        ("json_number_out_of_range", "in.jsonl", 4), ("invalid_json", "in.jsonl", 5), ("invalid_json", "in.jsonl", 6),
    ]
    [doc] = shards.records(out)
    assert doc["text"] == f"{MIT_GRANT} \ufffd" and doc["metadata"]["note\ufffd"] == "\ufffd"


def test_inputs_over_max_doc_bytes_are_quarantined_as_too_large_in_every_format(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.jsonl").write_text(
        json.dumps({"text": MIT_GRANT, "licence": "MIT"}) + "\n" + json.dumps({"text": "x" * 400, "licence": "MIT"})
    )
    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "big.txt").write_text(MIT_GRANT + MIT_NOTICE)
    (tmp_path / "prose" / "small.txt").write_text(GPL_INTRO)
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "gpl.html").write_text(PAGE)
    cfg = CollectConfig(sources=[
        SourceConfig(name="code", path="code", format="jsonl", domain="code"),
        SourceConfig(name="prose", path="prose", format="txt", domain="prose", licence="MIT"),
        SourceConfig(name="web", path="web", format="html", domain="web", licence="GPL-3.0-or-later"),
    ], max_doc_bytes=400)
    (tmp_path / "out").mkdir()
    stats = collect_documents(cfg, tmp_path / "out")
    assert (stats["num_in"], stats["num_kept"], stats["quarantined"]) == (5, 2, {"too_large": 3})
    too_large = shards.records(tmp_path / "out", "quarantine")
    assert [(q["source"], q["path"], q.get("line")) for q in too_large] == [
        ("code", "a.jsonl", 2), ("prose", "big.txt", None), ("web", "gpl.html", None)]
    assert "max_doc_bytes=400" in too_large[0]["detail"] and too_large[0]["raw_prefix"].startswith('{"text": "xxx')


def test_licences_as_real_data_writes_them(tmp_path):
    lines = [
        json.dumps({"text": MIT_GRANT, "license": "GPL-2+"}),  # 1 kept, as GPL-2.0-or-later
        json.dumps({"text": MIT_NOTICE, "licence": "GPL-2.0+ or CC-BY-SA-3.0"}),  # 2 kept: one branch allowed
        json.dumps({"text": GPL_INTRO, "license": "BSD-4-Clause-UC (fortune-mod; collected quotations)"}),  # 3
        json.dumps({"text": GPL_PATENTS, "licence": "Frobnicate | see copyright"}),  # 4 unknown
        json.dumps({"text": GPL_PATENTS, "licence": "MIT", "license": "GPL-2+"}),  # 5 which one?
        json.dumps({"text": GPL_PATENTS, "licence": ["MIT"]}),  # 6 not a string
    ]
    stats, out = _collect_one(tmp_path, lines)
    assert stats["removed"] == {"licence_not_allowed:BSD-4-Clause-UC": 1, "licence_unknown:Frobnicate | see copyright": 1}
    assert stats["quarantined"] == {"invalid_licence": 2}
    docs = shards.records(out)
    assert [(d["licence"], d["metadata"]["licence_as_written"]) for d in docs] == [
        ("GPL-2.0-or-later", "GPL-2+"), ("GPL-2.0-or-later OR CC-BY-SA-3.0", "GPL-2.0+ or CC-BY-SA-3.0")]

    licences = json.loads((out / "compliance.json").read_text())["sources"][0]["licences"]
    assert licences["GPL-2.0-or-later"] == {"status": "allowed", "allowed": True, "num_docs": 1,
                                            "as_written": {"GPL-2+": 1}}
    assert licences["Frobnicate | see copyright"]["status"] == "unknown"
    markdown = (out / "compliance.md").read_text()
    assert "Frobnicate \\| see copyright (UNKNOWN, 1)" in markdown  # escaped: the table holds
    assert "| s | BSD-4-Clause-UC (fortune-mod; collected quotations) | BSD-4-Clause-UC | NOT allowed | 1 |" in markdown
    assert "| s | GPL-2+ | GPL-2.0-or-later | allowed | 1 |" in markdown


def test_licence_names_from_package_metadata_keep_their_documents(tmp_path):
    # issue 34: on a held-out corpus these spellings were unknown and their documents removed
    lines = [json.dumps({"text": text, "licence": licence}) for text, licence in [
        (MIT_GRANT, "The MIT License (MIT)"), (MIT_NOTICE, "MIT Licence"),
        (GPL_INTRO, "License :: OSI Approved :: Apache Software License")]]
    stats, out = _collect_one(tmp_path, lines)
    assert stats["removed"] == {} and stats["quarantined"] == {}
    assert [(d["licence"], d["metadata"]["licence_as_written"]) for d in shards.records(out)] == [
        ("MIT", "The MIT License (MIT)"), ("MIT", "MIT Licence"),
        ("Apache-2.0", "License :: OSI Approved :: Apache Software License")]


def test_licence_settings_are_checked_before_anything_is_written(corpus):
    with pytest.raises(ConfigError, match=r"collect.allowed_licences: allowed licence \[1\] 'MIT OR GPL-2\+'"):
        collect_documents(_config(allowed_licences=["MIT", "MIT OR GPL-2+"]), corpus)
    bad = SourceConfig(name="prose", path="data/prose", format="txt", domain="prose", licence="MIT OR")
    with pytest.raises(ConfigError, match=r"collect.sources\[0\].licence: 'MIT OR' is no SPDX licence expression"):
        collect_documents(CollectConfig(sources=[bad]), corpus)
    assert list(corpus.iterdir()) == []
