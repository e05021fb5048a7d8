"""Dedup's partitioned clustering (`tasks.data.dedup_partition`) decides exactly what one process
holding every signature decides (`dedup.cluster`), for any number of partitions, and the driver's
part of it reads no signature."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.tasks.data import dedup_index, dedup_partition
from kiln.tasks.data.dedup import DedupConfig, cluster, lsh_bands, sign_shard, signature_settings, verify_threshold
from kiln.tasks.data.dedup_index import DedupIndex
from kiln.tasks.data.documents import Document, write_documents
from kiln.tasks.data.minhash import BUCKET_WINDOW

_WORDS = [f"w{i}" for i in range(400)]


def _text(rng: np.random.Generator, words: int = 60) -> str:
    return " ".join(rng.choice(_WORDS, size=words).tolist())


def _edited(rng: np.random.Generator, text: str, changes: int) -> str:
    words = text.split()
    for at in rng.choice(len(words), size=changes, replace=False).tolist():
        words[at] = str(rng.choice(_WORDS))
    return " ".join(words)


def _batches() -> tuple[list[Document], list[Document]]:
    """A first batch (to index) and a second: exact and near copies within and across shards and of
    indexed documents, a bucket of more than `BUCKET_WINDOW` near copies, texts without shingles,
    scores on some documents."""
    rng = np.random.default_rng(7)
    first, second = [], []
    bases = [_text(rng) for _ in range(40)]
    for i, base in enumerate(bases[:20]):
        first.append(Document(f"a{i:03d}", base, "s", "prose", "MIT", {"quality_score": round(float(rng.random()), 2)}))
    first += [Document(f"a-near{i}", _edited(rng, bases[i], 2), "s", "prose", "MIT", {}) for i in range(5)]
    wide = _text(rng, 200)  # one text and many copies a word longer: buckets wider than the window
    first += [Document(f"wide-a{i:03d}", f"{wide} a{i}", "s", "web", "MIT", {}) for i in range(BUCKET_WINDOW + 6)]
    second += [Document(f"wide-b{i:03d}", f"{wide} b{i}", "s", "web", "MIT", {}) for i in range(BUCKET_WINDOW + 9)]
    for i, base in enumerate(bases):
        second.append(Document(f"b{i:03d}", base.upper() if i % 3 == 0 else base, "s", "prose", "MIT", {}))
        second.append(Document(f"b-near{i:03d}", _edited(rng, base, 1 + i % 4), "s", "code", "MIT",
                               {"quality_score": 0.5} if i % 2 else {}))
    second += [Document(f"b-copy{i}", bases[30 + i] + " ", "s", "prose", "MIT", {}) for i in range(5)]
    second += [Document(f"empty{i}", "  ..." if i % 2 else "", "s", "prose", "MIT", {}) for i in range(3)]
    second += [Document(f"b-new{i}", _text(rng), "s", "prose", "MIT", {}) for i in range(30)]
    order = rng.permutation(len(second))
    return first, [second[i] for i in order.tolist()]


def _signed(tmp_path: Path, cfg: DedupConfig, docs: list[Document], num_shards: int, name: str) -> list:
    shards = []
    for k in range(num_shards):
        path = tmp_path / f"{name}-{k}.jsonl"
        write_documents(path, docs[k * len(docs) // num_shards:(k + 1) * len(docs) // num_shards])
        shards.append(sign_shard(cfg, path))
    return shards


def _partitioned(tmp_path: Path, cfg: DedupConfig, index_dir: Path | None, shards: list, parts: int,
                 hide_signatures: bool = False) -> dedup_partition.Decisions:
    folder = tmp_path / f"parts{parts}"
    for rank, signed in enumerate(shards):
        dedup_partition.write_shard_rows(signed, folder / "signed", rank, parts, lsh_bands(cfg), cfg.exact, cfg.fuzzy)
    m, chunks = 0, 1
    if index_dir is not None:
        m, chunks = dedup_partition.write_index_rows(index_dir, signature_settings(cfg), folder / "index", parts,
                                                     cfg.exact, cfg.fuzzy)
    rows = dedup_partition.Rows(folder / "signed", tuple(len(s.ids) for s in shards),
                                None if index_dir is None else folder / "index", m, chunks)
    found = [dedup_partition.cluster_partition(rows, part, parts, cfg.exact, verify_threshold(cfg), BUCKET_WINDOW)
             for part in range(parts)]
    if hide_signatures:  # the driver's part: every signature file out of reach
        for path in folder.rglob("*.signatures.npy"):
            path.rename(path.with_suffix(".hidden"))
    bands, rows_per_band = lsh_bands(cfg)
    return dedup_partition.decide(rows, found, cfg.exact, {"lsh": {"bands": bands, "rows": rows_per_band,
                                                                   "verify_threshold": verify_threshold(cfg)}})


@pytest.mark.parametrize("exact, fuzzy, index_chunk", [(True, True, 1 << 16), (True, True, 7), (False, True, 1 << 16),
                                                      (True, False, 1 << 16)])
def test_any_number_of_partitions_decides_what_one_process_decides(tmp_path, monkeypatch, exact, fuzzy, index_chunk):
    """...and the index is read in chunks of any size."""
    monkeypatch.setattr(dedup_partition, "_INDEX_CHUNK", index_chunk)
    cfg = DedupConfig(exact=exact, fuzzy=fuzzy)
    first, second = _batches()
    empty = DedupIndex.empty(signature_settings(cfg))
    indexed = cluster(cfg, empty, _signed(tmp_path, cfg, first, 2, "first"))
    indexed.index.save(tmp_path / "index")
    shards = _signed(tmp_path, cfg, second, 3, "second")
    expected = cluster(cfg, indexed.index, shards)
    # copies within and across shards and of the index; near copies too, a bucket of them wider than the window
    assert sum(map(len, expected.removed)) > (BUCKET_WINDOW + 40 if fuzzy else 20)
    if fuzzy:
        assert expected.stats["num_verified_pairs"] > BUCKET_WINDOW
    for parts in (1, 2, 7):
        got = _partitioned(tmp_path, cfg, tmp_path / "index", shards, parts)
        assert got.removed == expected.removed, parts
        assert got.stats == expected.stats, parts
        assert got.sizes == expected.sizes, parts


def test_the_driver_reads_no_signature_and_needs_no_index(tmp_path):
    """`decide` runs with every signature file gone: it reads only pairs, and ids, scores, lengths,
    digests and snippets of the documents in them."""
    cfg = DedupConfig()
    first, second = _batches()
    indexed = cluster(cfg, DedupIndex.empty(signature_settings(cfg)), _signed(tmp_path, cfg, first, 1, "first"))
    indexed.index.save(tmp_path / "index")
    shards = _signed(tmp_path, cfg, second, 2, "second")
    expected = cluster(cfg, indexed.index, shards)
    got = _partitioned(tmp_path, cfg, tmp_path / "index", shards, 3, hide_signatures=True)
    assert not list((tmp_path / "parts3").rglob("*.signatures.npy"))
    assert got.removed == expected.removed and got.stats == expected.stats


@pytest.mark.parametrize("merge_entries, copy_rows", [(1 << 20, 1 << 16), (5, 3)])
def test_the_index_streamed_from_parts_is_the_index_one_process_extends(tmp_path, monkeypatch, merge_entries,
                                                                          copy_rows):
    """`save_merged` of an unpacked index and each shard's kept part (merged a few keys and rows at a time
    when the limits are small) holds the arrays `DedupIndex.extended` builds."""
    monkeypatch.setattr(dedup_index, "_MERGE_ENTRIES", merge_entries)
    monkeypatch.setattr(dedup_index, "_COPY_ROWS", copy_rows)
    cfg = DedupConfig()
    settings = signature_settings(cfg)
    first, second = _batches()
    indexed = cluster(cfg, DedupIndex.empty(settings), _signed(tmp_path, cfg, first, 2, "first"))
    indexed.index.save(tmp_path / "index")
    shards = _signed(tmp_path, cfg, second, 3, "second")
    expected = cluster(cfg, indexed.index, shards).index
    parts = [(tmp_path / "parts", "index")]
    assert dedup_index.unpack(tmp_path / "index", settings, *parts[0]) == len(indexed.index)
    for rank, (signed, removed) in enumerate(zip(shards, cluster(cfg, indexed.index, shards).removed)):
        keep = np.ones(len(signed.ids), dtype=bool)
        keep[list(removed)] = False
        dedup_partition.write_shard_rows(signed, tmp_path / "parts", rank, 1, lsh_bands(cfg), True, True)
        dedup_index.save_part(tmp_path / "parts", f"{rank:05d}", settings, np.flatnonzero(keep), signed.ids,
                              signed.snippets, signed.signatures, signed.has_shingles)
        parts.append((tmp_path / "parts", f"{rank:05d}"))
    assert dedup_index.save_merged(tmp_path / "merged", settings, parts) == len(expected)
    merged = DedupIndex.load(tmp_path / "merged", settings)
    assert expected.table_keys.shape[1] == 100  # in the LSH, of 101 kept documents (one of them empty)
    for field in dedup_index._ARRAY_FIELDS:
        got, want = getattr(merged, field), getattr(expected, field)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes()), field


def test_empty_batches_and_shards_pass_through_the_partitions(tmp_path):
    """No input shard, an empty shard, and a batch of nothing against an index: each runs, and the index
    carries on to the next batch."""
    from kiln.tasks.data.dedup_index import INDEX_DIR
    from kiln.tasks.data.dedup_job import dedup_documents

    outs = [tmp_path / f"out{i}" for i in range(4)]
    for out in outs:
        out.mkdir()
    write_documents(tmp_path / "a.jsonl", [Document("x", "one two three four five six", "s", "prose", "MIT", {})])
    (tmp_path / "empty.jsonl").write_text("")
    assert dedup_documents(DedupConfig(), [], outs[0], plots=False)["num_in"] == 0
    stats = dedup_documents(DedupConfig(), [tmp_path / "a.jsonl", tmp_path / "empty.jsonl"], outs[1], plots=False)
    assert (stats["num_in"], stats["num_kept"]) == (1, 1)
    stats = dedup_documents(DedupConfig(), [], outs[2], index_dir=outs[1] / INDEX_DIR, plots=False)
    assert (stats["num_in"], stats["num_indexed_before"]) == (0, 1)
    stats = dedup_documents(DedupConfig(), [tmp_path / "a.jsonl"], outs[3], index_dir=outs[2] / INDEX_DIR, plots=False)
    assert stats["removed"] == {"exact_duplicate": 1} and stats["num_indexed_before"] == 1


def test_the_stage_with_partition_jobs_writes_what_it_writes_with_one_partition(tmp_path, monkeypatch):
    """`dedup_documents` with a partition job of several ranks (a small partition size), against an index:
    the same documents kept and removed, the same stats, the same index arrays as with one partition."""
    from kiln.tasks.data import dedup_job
    from kiln.tasks.data.dedup_index import INDEX_DIR
    from kiln.tasks.data.shards import KINDS
    from tests.fixtures.shards import raw

    first, second = _batches()
    inputs = {}
    for name, docs, num_shards in (("first", first, 2), ("second", second, 3)):
        inputs[name] = []
        for k in range(num_shards):
            inputs[name].append(tmp_path / f"{name}-{k}.jsonl")
            write_documents(inputs[name][-1], docs[k * len(docs) // num_shards:(k + 1) * len(docs) // num_shards])
    runs = {}
    for label, partition_bytes in (("one", 1 << 26), ("many", 4096)):
        monkeypatch.setattr(dedup_job, "_PARTITION_BYTES", partition_bytes)
        outs = [tmp_path / label / "first", tmp_path / label / "second"]
        for out in outs:
            out.mkdir(parents=True)
        dedup_job.dedup_documents(DedupConfig(), inputs["first"], outs[0], plots=False)
        stats = dedup_job.dedup_documents(DedupConfig(), inputs["second"], outs[1], index_dir=outs[0] / INDEX_DIR,
                                          plots=False)
        stats.pop("executor_cpu_s")
        index = DedupIndex.load(outs[1] / INDEX_DIR, signature_settings(DedupConfig()))
        runs[label] = (stats, [raw(outs[1], kind) for kind in KINDS],
                       {field: getattr(index, field).tobytes() for field in dedup_index._ARRAY_FIELDS})
    assert dedup_job.num_partitions(inputs["second"], tmp_path / "many" / "first" / INDEX_DIR) > 5
    assert runs["one"] == runs["many"]
    assert runs["one"][0]["num_removed"] > BUCKET_WINDOW + 40
