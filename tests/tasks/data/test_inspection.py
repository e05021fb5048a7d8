"""Inspection: datatrove's log lines in the stage's log file (not the terminal), documents and bytes per
domain and filter, the removals plot, and `kiln inspect`."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.data.clean import CleanConfig, clean_documents
from kiln.tasks.data.datatrove_logs import LOG_FILE
from kiln.tasks.data.documents import Document
from kiln.tasks.data.inspection import REPORT_JSON, REPORT_MD, REPORT_PNG, accounting, samples
from kiln.tasks.runner import run_stage
from tests.fixtures.shards import write_stage

REPO = Path(__file__).resolve().parents[3]
PROSE = (REPO / "data/sample/prose/coreutils-man/ls.1.txt").read_text()
TOY = str(REPO / "tests/fixtures/toy.yaml")


def _documents(folder: Path) -> Path:
    docs = [
        Document("good", PROSE, "s", "prose", "MIT"),
        Document("short", "Too short to be a page.", "s", "prose", "MIT"),
        Document("code", "def f():\n    return 1\n" * 5, "c", "code", "MIT"),
        Document("short-web", "Home | About | Contact", "w", "web", "MIT"),
    ]
    return write_stage(folder, docs, 2)


def test_datatrove_logs_go_to_the_stage_log_file_not_the_terminal(tmp_path, capfd):
    source = _documents(tmp_path / "in")
    cfg = CleanConfig(quality_model=None, languages=["en"], num_workers=2)
    stats = clean_documents(cfg, source, tmp_path / "out")
    terminal = capfd.readouterr()
    assert "Launching pipeline" not in terminal.err + terminal.out and "PIPELINE" not in terminal.err + terminal.out
    log = (tmp_path / "out" / LOG_FILE).read_text()
    assert "===== task_00000.log =====" in log and "===== task_00001.log =====" in log
    assert "Launching pipeline for rank=0" in log and "Processing done for rank=1" in log
    assert stats["num_in"] == 4


def test_accounting_counts_documents_and_bytes_by_domain_and_filter(tmp_path):
    source = _documents(tmp_path / "in")
    out = tmp_path / "out"
    stats = clean_documents(CleanConfig(quality_model=None, languages=["en"]), source, out)
    table = stats["accounting"]
    assert table == accounting(out)  # tallied shard by shard while writing: what the shards hold
    prose, web = table["prose"], table["web"]
    assert prose["in"] == {"docs": 2, "bytes": len(PROSE.encode()) + len(b"Too short to be a page.")}
    assert prose["kept"]["docs"] + sum(c["docs"] for c in prose["removed"].values()) == 2
    assert web["kept"]["docs"] == 0 and web["removed"]["language"] == {"docs": 1, "bytes": 22}
    assert sum(c["docs"] for row in table.values() for c in row["removed"].values()) == stats["num_removed"]
    assert "| web | removed | language | 1 |" in (out / REPORT_MD).read_text()
    assert (out / REPORT_PNG).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / REPORT_JSON).read_text()) == table

    removed = list(samples(out, reason="language", domain="web"))
    assert [s["record"]["id"] for s in removed] == ["short-web"]  # in the second shard
    assert [s["record"]["id"] for s in samples(out, outcome="kept", domain="code")] == ["code"]
    assert list(samples(out, reason="language", domain="code")) == []


def test_kiln_inspect_prints_samples_with_their_reasons(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    work = f"work_dir={tmp_path}"
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "ok", "text": PROSE, "licence": "MIT"}, {"id": "gfdl", "text": PROSE + " x", "licence": "GFDL-1.3-or-later"},
        {"text": "no licence"}]))
    # records may also be of the other domains the default config's filters and mixtures name (they are all prose)
    sources = (f"collect.sources=[{{name: s, path: {tmp_path / 'in'}, format: jsonl, domain: prose, domain_field: domain, "
               "domains: [web, code, multilingual]}]")
    run_stage("collect", load_config(TOY, [work, sources]))
    assert main(["inspect", "collect", TOY, work, sources]) == 0
    out = capsys.readouterr().out
    assert "s/gfdl | prose | licence_not_allowed:GFDL-1.3-or-later | source=s, path=a.jsonl, line=2" in out
    assert main(["inspect", "collect", TOY, work, sources, "--quarantined", "-n", "1"]) == 0
    assert "missing_licence" in capsys.readouterr().out
    assert main(["inspect", "collect", TOY, work, sources, "--reason", "gopher_quality"]) == 0
    assert "removed by filter: licence_not_allowed; domains: prose" in capsys.readouterr().out
    assert main(["inspect", "clean", TOY, work, sources]) == 2  # not run yet: says how to run it


def test_loguru_computes_its_library_folders_once_a_process():
    # issue 34: each loguru sink's exception formatter asked sysconfig for ~40 paths, three sinks a rank;
    # `datatrove_logs` caches loguru's private `ExceptionFormatter._get_lib_dirs`: this fails on a loguru without it
    from loguru._better_exceptions import ExceptionFormatter

    assert hasattr(ExceptionFormatter._get_lib_dirs, "cache_info")
    first, second = ExceptionFormatter(), ExceptionFormatter()
    assert first._lib_dirs == second._lib_dirs == ExceptionFormatter._get_lib_dirs.__wrapped__()
    assert ExceptionFormatter._get_lib_dirs.cache_info().hits >= 1
