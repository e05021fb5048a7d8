"""Collect's reading as executor tasks: a source's files cut into tasks, and the output byte for byte that
of one task reading every source in order, duplicate ids across tasks included."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiln.tasks.data.collect import CollectConfig, collect_documents
from kiln.tasks.data.collect_plan import plan_tasks
from kiln.tasks.data.collect_ids import find_earlier_kept, read_ids, write_checked
from kiln.tasks.data.executors import ExecutorSettings
from kiln.tasks.data.shards import KINDS
from kiln.tasks.data.sources import SourceConfig
from tests.fixtures import shards

TEXTS = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
    "The above copyright notice and this permission notice shall be included in all copies.",
    "The GNU General Public License is a free, copyleft license for software and other kinds of works.",
    "Finally, every program is threatened constantly by software patents.",
]


def _files(folder: Path, files: dict[str, list[dict | str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        (folder / name).write_text("".join(line + "\n" for line in lines))


def _repeating_ids(root: Path) -> list[SourceConfig]:
    """Two sources whose files repeat ids: kept, removed for their licence, quarantined, and unnamed records."""
    _files(root / "a", {
        "1.jsonl": [{"id": 1, "text": TEXTS[0]}, {"id": 2, "text": TEXTS[1], "licence": "BSD-4-Clause"},
                    {"text": TEXTS[2]}, "{broken"],
        "2.jsonl": [{"id": 1, "text": TEXTS[3]},  # kept in 1.jsonl: a duplicate
                    {"id": 2, "text": TEXTS[0]},  # removed (licence) in 1.jsonl, so kept here
                    {"id": 3, "text": TEXTS[1], "licence": "BSD-4-Clause"}],
        "3.jsonl": [{"id": 2, "text": TEXTS[2]},  # kept in 2.jsonl: a duplicate
                    {"id": 3, "text": TEXTS[3]},  # removed in 2.jsonl: kept
                    {"id": 1, "text": TEXTS[1], "licence": "BSD-4-Clause"},  # a duplicate before its licence is judged
                    {"id": 4, "text": " "}],
    })
    _files(root / "b", {"1.jsonl": [{"id": 1, "text": TEXTS[0]}], "2.jsonl": [{"id": 1, "text": TEXTS[1]}]})
    return [SourceConfig(name="a", path=str(root / "a"), format="jsonl", domain="code", licence="MIT"),
            SourceConfig(name="b", path=str(root / "b"), format="jsonl", domain="prose", licence="MIT")]


def _collect(sources: list[SourceConfig], out: Path, executor: ExecutorSettings | None = None, **extra) -> dict:
    out.mkdir(parents=True)
    cfg = CollectConfig(sources=sources, **extra)
    return collect_documents(cfg, out) if executor is None else collect_documents(cfg, out, executor)


def _outputs(out: Path) -> dict[str, bytes]:
    return {kind: shards.raw(out, kind) for kind in KINDS} | {
        name: (out / name).read_bytes() for name in ("compliance.json", "removals.json")}


def test_a_task_per_file_writes_what_one_task_writes(tmp_path):
    sources = _repeating_ids(tmp_path)
    one = _collect(sources, tmp_path / "one")
    many = _collect(sources, tmp_path / "many", shard_bytes=1, task_bytes=100)  # a task per file, or per 100 bytes of one
    assert (one["num_tasks"], many["num_tasks"]) == (1, 12)
    assert _outputs(tmp_path / "many") == _outputs(tmp_path / "one")
    drop = ("shards", "num_tasks", "executor_cpu_s")
    assert {k: v for k, v in many.items() if k not in drop} == {k: v for k, v in one.items() if k not in drop}
    assert [d["id"] for d in shards.records(tmp_path / "many")] == ["a/1", "a/1.jsonl:3", "a/2", "a/3", "b/1"]
    assert [(q["reason"], q["path"], q["line"]) for q in shards.records(tmp_path / "many", "quarantine")] == [
        ("invalid_json", "1.jsonl", 4), ("duplicate_id", "2.jsonl", 1), ("duplicate_id", "3.jsonl", 1),
        ("duplicate_id", "3.jsonl", 3), ("empty_text", "3.jsonl", 4), ("duplicate_id", "2.jsonl", 1)]
    assert many["num_in"] == 13 == many["num_kept"] + many["num_removed"] + many["num_quarantined"]
    # kept documents in shards of shard_bytes as one process cuts them; removed and quarantined ones in each task's
    assert [s["path"] for s in many["shards"]["documents"]] == [f"documents/{i:05d}.jsonl.zst" for i in range(5)]
    quarantine = [s["path"] for s in many["shards"]["quarantine"]]
    assert len(quarantine) == 6 and all(re.fullmatch(r"quarantine/\d{5}\.\d{5}\.jsonl\.zst", q) for q in quarantine)
    assert not (tmp_path / "many" / "_collect").exists()


def test_two_workers_write_what_one_writes(tmp_path):
    sources = _repeating_ids(tmp_path)
    one = _collect(sources, tmp_path / "one", shard_bytes=100, task_bytes=100)
    two = _collect(sources, tmp_path / "two", ExecutorSettings("local"), shard_bytes=100, task_bytes=100, num_workers=2)
    assert _outputs(tmp_path / "two") == _outputs(tmp_path / "one")
    assert two["shards"] == one["shards"]


def test_a_capped_source_is_one_task_and_keeps_its_first_documents_in_file_order(tmp_path):
    """Source `x/y`'s ids (`x/y/1`) are those of source `x`'s records `y/1`: the capped source, a later
    task, must skip its first record (kept by `x`) and keep its next two, as one process would."""
    _files(tmp_path / "x", {"1.jsonl": [{"id": "y/1", "text": TEXTS[0]}]})
    _files(tmp_path / "xy", {"1.jsonl": [{"id": 1, "text": TEXTS[1]}, {"id": 2, "text": TEXTS[2]}],
                             "2.jsonl": [{"id": 3, "text": TEXTS[3]}, {"id": 4, "text": TEXTS[0]}]})
    sources = [SourceConfig(name="x", path=str(tmp_path / "x"), format="jsonl", domain="code", licence="MIT"),
               SourceConfig(name="x/y", path=str(tmp_path / "xy"), format="jsonl", domain="code", licence="MIT")]
    cfg = CollectConfig(sources=sources, max_docs_per_source=2, task_bytes=1)
    assert [[len(part.files) for part in task] for task in plan_tasks(cfg.sources, cfg.task_bytes, read_whole=True)] == [[1], [2]]
    stats = _collect(sources, tmp_path / "out", max_docs_per_source=2, task_bytes=1)
    assert [d["id"] for d in shards.records(tmp_path / "out")] == ["x/y/1", "x/y/2", "x/y/3"]
    assert stats["quarantined"] == {"duplicate_id": 1} and stats["by_source"] == {"x": 1, "x/y": 2}
    assert json.loads((tmp_path / "out" / "compliance.json").read_text())["sources"][1]["capped"] is True


def test_files_are_grouped_into_tasks_by_bytes(tmp_path):
    _files(tmp_path / "s", {f"{i}.jsonl": [{"id": i, "text": TEXTS[0]}] for i in range(6)})
    source = SourceConfig(name="s", path=str(tmp_path / "s"), format="jsonl", domain="code", licence="MIT")
    size = (tmp_path / "s" / "0.jsonl").stat().st_size
    tasks = plan_tasks(CollectConfig(sources=[source]).sources, task_bytes=2 * size)
    assert [[file.rel for part in task for file in part.files] for task in tasks] == [
        ["0.jsonl", "1.jsonl"], ["2.jsonl", "3.jsonl"], ["4.jsonl", "5.jsonl"]]


@pytest.mark.parametrize("slice_entries", [1, 3, 1000])
def test_ids_kept_by_an_earlier_run_are_found_slice_by_slice(tmp_path, slice_entries):
    runs = [(["a", "b", "c", "a"], [True, True, False, False]),
            (["c", "d", "a", "b"], [True, True, False, True]),
            (["d", "c", "e", "b"], [False, False, True, False])]
    stems = [tmp_path / "runs" / f"{t:05d}" for t in range(3)]
    for stem, (ids, kept) in zip(stems, runs):
        write_checked(stem, ids, kept)
    found = find_earlier_kept(stems, tmp_path / f"found-{slice_entries}", slice_entries)
    assert {t: read_ids(path) for t, path in found.items()} == {1: {"a", "b"}, 2: {"b", "c", "d"}}


def test_kept_shards_are_cut_where_one_process_cuts_them(tmp_path):
    """A cap no source reaches reads each source in one task; without it every file (or 300 bytes of one) is
    a task: the kept shards (about 300 bytes each, cut across the tasks' boundaries) are the same files either way."""
    sources = _repeating_ids(tmp_path)
    whole = _collect(sources, tmp_path / "whole", shard_bytes=300, task_bytes=300, max_docs_per_source=1000)
    split = _collect(sources, tmp_path / "split", shard_bytes=300, task_bytes=300)
    assert (whole["num_tasks"], split["num_tasks"]) == (2, 4)
    assert split["shards"]["documents"] == whole["shards"]["documents"]
    assert [s["num_records"] for s in split["shards"]["documents"]] == [2, 2, 1]  # the second: a line of 2.jsonl and one of 3.jsonl
    assert _outputs(tmp_path / "split") == _outputs(tmp_path / "whole")


@pytest.mark.parametrize("shard_bytes", [37, 64, 150, 10_000])
def test_a_big_jsonl_file_is_cut_into_ranges_of_lines_read_as_one_process_reads_them(tmp_path, shard_bytes):
    """Ranges of `task_bytes` (here `shard_bytes` too) start and end inside lines (a BOM, blank and CRLF lines, one line over
    max_doc_bytes across several ranges, broken JSON, records without ids numbered by line, a repeated
    id, no newline at the end): every record, its line number and outcome as when one task reads the file."""
    lines = [b"\xef\xbb\xbf" + json.dumps({"id": 1, "text": TEXTS[0]}).encode(), b"", b"   ",
             json.dumps({"text": TEXTS[1]}).encode() + b"\r", json.dumps({"text": "x" * 300}).encode(),
             b"{broken", json.dumps({"id": 1, "text": TEXTS[2]}).encode(), json.dumps({"text": TEXTS[3]}).encode(),
             json.dumps({"id": 2, "text": TEXTS[0], "licence": "BSD-4-Clause"}).encode(),
             json.dumps({"text": TEXTS[2]}).encode()]
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.jsonl").write_bytes(b"\n".join(lines))  # no newline after the last
    sources = [SourceConfig(name="s", path=str(tmp_path / "big"), format="jsonl", domain="code", licence="MIT")]
    ranged = CollectConfig(sources=sources, task_bytes=shard_bytes, max_doc_bytes=200)
    num_ranges = -(-(tmp_path / "big" / "a.jsonl").stat().st_size // shard_bytes)
    assert sum(len(part.files) for task in plan_tasks(ranged.sources, ranged.task_bytes) for part in task) == (num_ranges if shard_bytes < 1000 else 1)
    whole = _collect(sources, tmp_path / "whole", shard_bytes=shard_bytes, max_doc_bytes=200, max_docs_per_source=100)
    split = _collect(sources, tmp_path / "split", shard_bytes=shard_bytes, task_bytes=shard_bytes, max_doc_bytes=200)
    assert _outputs(tmp_path / "split") == _outputs(tmp_path / "whole")
    assert split["shards"]["documents"] == whole["shards"]["documents"]
    assert [d["id"] for d in shards.records(tmp_path / "split")] == ["s/1", "s/a.jsonl:4", "s/a.jsonl:8", "s/a.jsonl:10"]
    assert [(q["reason"], q["line"]) for q in shards.records(tmp_path / "split", "quarantine")] == [
        ("too_large", 5), ("invalid_json", 6), ("duplicate_id", 7)]
    compliance = json.loads((tmp_path / "split" / "compliance.json").read_text())["sources"][0]
    assert compliance["num_files"] == 1 and compliance["capped"] is False
