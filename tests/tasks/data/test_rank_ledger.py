"""A data job's ranks are recorded in the run ledger: a rerun reuses exactly the ranks whose key still
holds (the job's settings, the content of what the rank reads), whichever executor ran them.

Jobs run for real on the local executor (datatrove's worker processes); each rank logs when it runs,
so a test sees which ranks a rerun ran again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.tasks.data.executors import LOCAL, RANKS_DIR, map_shards, rank_ledger
from kiln.tasks.ledger import RankRecords, rank_key
from kiln.tasks.store import Store, file_sha256, recorded_sha256
from tests.fixtures.rank_work import CopyShard


def _inputs(folder: Path, texts: list[bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:05d}.in" for i in range(len(texts))]
    for path, text in zip(paths, texts):
        path.write_bytes(text)
    return paths


def _job(tmp_path: Path, inputs: list[Path], settings: dict, fail_rank: int | None = None, jobs: int = 2
         ) -> tuple[list[int], dict]:
    """Run the copy job over `inputs`; which ranks ran (in any order), and what the job's results add up to."""
    log = tmp_path / "runs.log"
    log.unlink(missing_ok=True)
    work = tmp_path / "work"
    ledger = rank_ledger(work / RANKS_DIR, "kiln_copy", settings, [{"shard": path} for path in inputs])
    run = map_shards(CopyShard(inputs, tmp_path / "out", log, fail_rank), work, ledger, settings=LOCAL, jobs=jobs,
                     job_name="kiln_copy", outputs=[tmp_path / "out"])
    ran = sorted(int(line) for line in log.read_text().split()) if log.is_file() else []
    return ran, {"num_bytes": run.total("num_bytes"), "by_rank": run.total("by_rank")}


def test_a_rerun_reuses_ranks_whose_input_content_is_unchanged_and_reruns_the_changed_one(tmp_path):
    inputs = _inputs(tmp_path / "in", [b"alpha", b"beta", b"gamma"])
    assert _job(tmp_path, inputs, {"mode": "upper"}) == ([0, 1, 2], {"num_bytes": 14, "by_rank": {"0": 1, "1": 1, "2": 1}})
    assert _job(tmp_path, inputs, {"mode": "upper"})[0] == []  # every record holds: nothing runs, results kept

    # shard 1 gets other bytes of the same size, and its old modification time back: its content is new
    stat = inputs[1].stat()
    inputs[1].write_bytes(b"zeta")
    os.utime(inputs[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (inputs[1].stat().st_size, inputs[1].stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    ran, totals = _job(tmp_path, inputs, {"mode": "upper"})
    assert ran == [1] and totals["num_bytes"] == 14
    assert (tmp_path / "out" / "00001.txt").read_bytes() == b"ZETA"

    assert _job(tmp_path, inputs, {"mode": "other"})[0] == [0, 1, 2]  # a changed setting reuses no rank


def test_a_rank_that_died_is_the_only_one_run_again(tmp_path):
    inputs = _inputs(tmp_path / "in", [b"one", b"two", b"three"])
    with pytest.raises(RuntimeError, match="rank 2 dies"):  # one worker: ranks 0 and 1 finished before
        _job(tmp_path, inputs, {}, fail_rank=2, jobs=1)
    assert sorted(int(line) for line in (tmp_path / "runs.log").read_text().split()) == [0, 1, 2]
    assert not (tmp_path / "out" / "00002.txt").exists()
    ran, totals = _job(tmp_path, inputs, {})
    assert ran == [2] and totals == {"num_bytes": 11, "by_rank": {"0": 1, "1": 1, "2": 1}}


def test_datatrove_skips_exactly_the_ranks_the_ledger_holds_complete(tmp_path):
    """The ledger, not datatrove's markers, decides: a marker without a record for the rank's key runs the
    rank again; a record whose rank's datatrove stats are missing (killed in between) or cut short (killed
    while datatrove wrote them) too; the outputs of ranks no longer in the job are removed."""
    inputs = _inputs(tmp_path / "in", [b"a", b"b", b"c", b"d"])
    assert _job(tmp_path, inputs, {})[0] == [0, 1, 2, 3]
    logs = tmp_path / "work" / "logs"
    RankRecords(tmp_path / "work" / RANKS_DIR).discard(0)  # its marker stays: datatrove alone would skip it
    (logs / "stats" / "00001.json").unlink()
    (logs / "stats" / "00002.json").write_text("")
    (logs / "stats" / "00003.json").write_text((logs / "stats" / "00003.json").read_text()[:10])
    assert _job(tmp_path, inputs, {})[0] == [0, 1, 2, 3]
    assert _job(tmp_path, inputs, {})[0] == []
    assert sorted(p.name for p in (logs / "completions").iterdir()) == ["00000", "00001", "00002", "00003"]

    ran, totals = _job(tmp_path, inputs[:2], {})  # a job of two ranks where there were four
    assert ran == [] and totals["by_rank"] == {"0": 1, "1": 1}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["00000.txt", "00001.txt"]
    assert sorted(p.name for p in (tmp_path / "work" / RANKS_DIR).iterdir()) == ["00000.json", "00001.json"]


def test_a_rank_key_hashes_the_content_the_store_recorded_for_its_input(tmp_path):
    store = Store(tmp_path / "store")
    partial = store.begin("clean", "k1")
    (partial / "documents").mkdir()
    (partial / "documents" / "00000.jsonl.zst").write_bytes(b"shard bytes")
    committed = store.commit("clean", "k1", {"stage": "clean"}) / "documents" / "00000.jsonl.zst"
    listed = store.manifest("clean", "k1")["files"]["documents/00000.jsonl.zst"]["sha256"]
    assert recorded_sha256(committed) == listed == file_sha256(committed)
    # the store's record is used as it is: a manifest saying otherwise is believed...
    manifest = store.path("clean", "k1") / "_kiln_manifest.json"
    manifest.write_text(manifest.read_text().replace(listed, "0" * 64))
    assert recorded_sha256(committed) == "0" * 64
    # ...until the file changes after its folder's commit: then it is hashed again
    os.utime(committed, ns=(manifest.stat().st_mtime_ns + 10**9, manifest.stat().st_mtime_ns + 10**9))
    assert recorded_sha256(committed) == listed
    outside = tmp_path / "loose.jsonl"
    outside.write_bytes(b"x")
    assert recorded_sha256(outside) == file_sha256(outside)
    key = rank_key("kiln_clean", {"config": {"a": 1}}, {"shard": listed})
    assert key != rank_key("kiln_clean", {"config": {"a": 2}}, {"shard": listed})
    assert key != rank_key("kiln_clean", {"config": {"a": 1}}, {"shard": "0" * 64})
