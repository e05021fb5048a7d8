"""The dedup stage on `cluster.executor`: signatures per shard in parallel, clusters by partition in
parallel, each shard's kept and removed documents written in parallel; nothing the size of the corpus
in this process.

`dedup_documents` runs the fast engine (`tasks.data.dedup`, `tasks.data.dedup_partition`): a shard
job signs every input shard (digests, MinHash signatures, ids, lengths, scores, snippets: no text)
and splits its digests and band keys into partition files (one partition per 64 MB of input,
`num_partitions`); an
earlier batch's index is unpacked and split the same way (a one-rank job); a partition job finds
each partition's exact copies and verified candidate pairs; this process reads only those pairs,
finds the clusters over the documents in them and decides their fate; a second shard job writes
the kept and removed shards from the decisions, tallying as it writes, and saves each shard's kept
documents as a part of the index, which this process streams into `lsh_index/`. The output equals
what one process reading the whole input would write (`dedup.cluster`). A rerun after a failure
keeps each rank a job finished while its key holds (the run ledger's: the settings and the content
of what the rank reads: its input shard; for partitions, every shard's signing key and the index;
for writing, its shard's decisions).
`WriteDecisions` is the datatrove engine's last step too.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.data.dedup import (
    PLOT_FILE,
    DedupConfig,
    SignedShard,
    lsh_bands,
    plot_cluster_sizes,
    sign_shard,
    signature_settings,
    verify_threshold,
    write_shard,
)
from kiln.tasks.data.dedup_index import INDEX_ARRAYS, INDEX_DIR, check_settings, save_merged, save_part
from kiln.tasks.data.dedup_partition import (
    INDEX_RANK,
    Rows,
    cluster_partition,
    decide,
    write_index_rows,
    write_shard_rows,
)
from kiln.tasks.data.minhash import BUCKET_WINDOW
from kiln.tasks.data.executors import LOCAL, RANKS_DIR, ExecutorSettings, ShardRun, map_shards, rank_ledger
from kiln.tasks.data.inspection import REPORT_PNG, plot, write_removal_report
from kiln.tasks.data.shards import KINDS, RankShards
from kiln.tasks.store import recorded_sha256

WORK_DIR = "_dedup"  # the jobs' logs, markers, signatures and decisions, while the stage runs
_SIGNED = "signed"
_DECISIONS = "decisions"
_WRITE_FACTS = ("ids", "domains", "text_bytes", "canonical", "has_metadata")
_PARTITION_BYTES = 64 << 20  # input bytes per clustering partition
_ZSTD_RATIO = 4  # what a zstd-compressed shard of text expands to, about
_MAX_PARTITIONS = 1024


@dataclass(frozen=True)
class _Sign:
    """Rank r: sign input shard r into `target/`: what writing needs in `NNNNN.npz`, what clustering
    needs as row files and `parts` partition files (`dedup_partition.write_shard_rows`)."""

    cfg: DedupConfig
    shards: list[Path]
    target: Path
    parts: int
    bands: tuple[int, int]  # `lsh_bands(cfg)`, found by the driver: it imports scipy, seconds in a fresh worker

    def __call__(self, rank: int) -> dict[str, Any]:
        signed = sign_shard(self.cfg, self.shards[rank])
        self.target.mkdir(parents=True, exist_ok=True)
        signed.save(self.target / f"{rank:05d}.npz", _WRITE_FACTS)
        write_shard_rows(signed, self.target, rank, self.parts, self.bands, self.cfg.exact, self.cfg.fuzzy)
        return {"num_docs": len(signed.ids)}


@dataclass(frozen=True)
class _IndexRows:
    """Rank 0: an earlier batch's index in `index_dir`, split as a shard is into `target/`."""

    cfg: DedupConfig
    index_dir: Path
    target: Path
    parts: int
    settings: dict[str, Any]  # `signature_settings(cfg)`

    def __call__(self, rank: int) -> dict[str, Any]:
        m, chunks = write_index_rows(self.index_dir, self.settings, self.target, self.parts, self.cfg.exact,
                                     self.cfg.fuzzy)
        return {"num_docs": m, "chunks": chunks}


@dataclass(frozen=True)
class _Partition:
    """Rank p: partition p's exact edges and verified candidate pairs into `target/NNNNN.npz`."""

    cfg: DedupConfig
    rows: Rows
    target: Path
    parts: int

    def __call__(self, rank: int) -> dict[str, Any]:
        found = cluster_partition(self.rows, rank, self.parts, self.cfg.exact, verify_threshold(self.cfg), BUCKET_WINDOW)
        self.target.mkdir(parents=True, exist_ok=True)
        np.savez(self.target / f"{rank:05d}.npz", **found)
        return {"num_pairs": len(found["inner"]) + len(found["cross"])}


@dataclass(frozen=True)
class WriteDecisions:
    """Rank r: write input shard r's kept and removed documents into `out_dir`. `decisions` holds
    `NNNNN.json` per shard ([position, reason, survivor id] of each removed document), or, with
    `by_id`, one `all.json` for every shard ({id: [reason, survivor id]}; ids are then unique).
    `signed`: the folder of the fast engine's `NNNNN.npz` per shard, whose ids, domains, byte counts
    and canonical flags let the writer copy lines without parsing them."""

    shards: list[Path]
    out_dir: Path
    decisions: Path
    by_id: bool = False
    signed: Path | None = None

    def __call__(self, rank: int) -> dict[str, Any]:
        if self.by_id:
            by_id = {doc_id: tuple(d) for doc_id, d in json.loads((self.decisions / "all.json").read_text()).items()}
            removed = lambda position, doc_id: by_id.get(doc_id)  # noqa: E731
        else:
            by_position = {p: (reason, survivor) for p, reason, survivor in
                           json.loads((self.decisions / f"{rank:05d}.json").read_text())}
            removed = lambda position, doc_id: by_position.get(position)  # noqa: E731
        signed = None if self.signed is None else SignedShard.load(self.signed / f"{rank:05d}.npz", _WRITE_FACTS)
        with RankShards(self.out_dir, rank) as shards:
            result = write_shard(self.shards[rank], shards, removed, signed)
            return result | {"shards": shards.close()}


@dataclass(frozen=True)
class _WriteAndIndex(WriteDecisions):
    """`WriteDecisions`, then rank r's kept documents as a part of the index (`dedup_index.save_part`:
    which rows of `signed/NNNNN.*` and their bucket tables), which the driver streams into `lsh_index/`
    with the others."""

    settings: dict[str, Any] | None = None

    def __call__(self, rank: int) -> dict[str, Any]:
        result = super().__call__(rank)
        assert self.signed is not None and self.settings is not None
        removed = [p for p, *_ in json.loads((self.decisions / f"{rank:05d}.json").read_text())]
        rows = {field: np.load(self.signed / f"{rank:05d}.{field}.npy")
                for field in ("ids", "snippets", "signatures", "has_shingles")}
        keep = np.ones(len(rows["ids"]), dtype=bool)
        keep[removed] = False
        save_part(self.signed, f"{rank:05d}", self.settings, np.flatnonzero(keep), **rows)
        return result


def num_partitions(inputs: list[Path], index_dir: Path | None = None) -> int:
    """Partitions for `inputs` and the index they are deduplicated against: one per `_PARTITION_BYTES`
    of input and saved index (a compressed shard counted at `_ZSTD_RATIO` times its size), at most
    `_MAX_PARTITIONS`. A partition rank holds some 400 bytes per document of its share (14 band keys
    and a digest entry, sorted), so 64 MB of input (some 20,000 typical web documents, 200,000 very
    short ones) keeps it near 100 MB; few partitions keep the files between the jobs (shards x
    partitions) few. Beyond 64 GB partitions grow instead of multiplying."""
    size = sum(path.stat().st_size * (_ZSTD_RATIO if path.suffix == ".zst" else 1) for path in inputs)
    size += 0 if index_dir is None else (index_dir / INDEX_ARRAYS).stat().st_size
    return max(1, min(_MAX_PARTITIONS, -(-size // _PARTITION_BYTES)))


def write_decisions(writer: WriteDecisions, work: Path, executor: ExecutorSettings, jobs: int, settings: Any,
                    draw: bool = True) -> tuple[ShardRun, dict[str, Any]]:
    """Run `writer` over its shards; the job's results and what they add up to: counts (as stats),
    `accounting` (removals.json/.md written, and removals.png if `draw`), `duplicate_rate_by_domain`,
    `shards` (the listing written). Rank r's key hashes `settings`, its input shard and its decisions (the
    one file of them all with `by_id`)."""
    decisions = [{} if writer.by_id else {"decisions": writer.decisions / f"{rank:05d}.json"}
                 for rank in range(len(writer.shards))]
    if writer.by_id:
        settings = {"settings": settings, "decisions": recorded_sha256(writer.decisions / "all.json")}
    ledger = rank_ledger(work / RANKS_DIR, "kiln_dedup_write", settings,
                         [{"shard": shard, **own} for shard, own in zip(writer.shards, decisions)])
    run = map_shards(writer, work, ledger, settings=executor, jobs=jobs, job_name="kiln_dedup_write",
                     outputs=[writer.out_dir / kind for kind in KINDS])
    table = run.tally().table()
    removed_by_domain = run.total("removed_by_domain") or {}
    return run, {
        **run.counts().as_dict(),
        "accounting": write_removal_report(writer.out_dir, "dedup", table, draw=draw),  # by domain and reason
        "duplicate_rate_by_domain": {d: removed_by_domain.get(d, 0) / row["in"]["docs"] for d, row in table.items()},
        "shards": run.listing(writer.out_dir),
    }


def dedup_documents(cfg: DedupConfig, inputs: list[Path], out_dir: Path, executor: ExecutorSettings = LOCAL,
                    index_dir: Path | None = None, phase_s: dict[str, float] | None = None, *,
                    plots: bool = True) -> dict:
    """Remove exact and near duplicates from the shards `inputs` into `out_dir` (against every document
    of the saved index in `index_dir`, if given, which always survive), on `executor` with
    `cfg.num_workers` tasks at a time; the combined index is saved in `out_dir/lsh_index/`. `phase_s`, if
    given, receives the seconds of each phase (sign, cluster, write, index, plot) for benchmarks.

    The two plots (removals.png, cluster_sizes.png) are drawn last, from the stats alone (`draw_plots`);
    `plots=False` leaves them to the caller (the benchmark draws them after its timed run)."""
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    inputs, out_dir = [path.resolve() for path in inputs], out_dir.resolve()
    settings = signature_settings(cfg)
    if index_dir is not None:
        index_dir = index_dir.resolve()
        check_settings(index_dir, settings)
    work = out_dir / WORK_DIR
    config = cfg.identity()

    phase_s = {} if phase_s is None else phase_s
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phase_s[name] = round(now - clock, 4)
        clock = now

    parts = num_partitions(inputs, index_dir)
    sign = work / "sign"
    signed_dir = sign / _SIGNED
    sign_ledger = rank_ledger(sign / RANKS_DIR, "kiln_dedup_sign", config, [{"shard": s} for s in inputs])
    signing = map_shards(_Sign(cfg, inputs, signed_dir, parts, lsh_bands(cfg)), sign, sign_ledger,
                         settings=executor, jobs=cfg.num_workers, job_name="kiln_dedup_sign", outputs=[signed_dir])
    phase("sign")
    jobs = [signing]
    identity = {"config": config, "signed": sign_ledger.keys, "parts": parts}
    index_rows, m, chunks = None, 0, 1
    if index_dir is not None:
        index_rows = work / "index"
        indexing = map_shards(_IndexRows(cfg, index_dir, index_rows / _SIGNED, parts, settings), index_rows,
                              rank_ledger(index_rows / RANKS_DIR, "kiln_dedup_index_rows", identity,
                                          [{"index": index_dir / INDEX_ARRAYS}]),
                              settings=executor, jobs=1, job_name="kiln_dedup_index_rows",
                              outputs=[index_rows / _SIGNED])
        jobs.append(indexing)
        index_rows, m, chunks = index_rows / _SIGNED, indexing.results[0]["num_docs"], indexing.results[0]["chunks"]
        identity["index"] = recorded_sha256(index_dir / INDEX_ARRAYS)
    rows = Rows(signed_dir, tuple(result["num_docs"] for result in signing.results), index_rows, m,
                index_chunks=chunks)
    partition = work / "partition"
    pairs_dir = partition / "pairs"
    if parts == 1:  # a partition of at most `_PARTITION_BYTES` of input: a job's bookkeeping cost more
        found = [cluster_partition(rows, 0, 1, cfg.exact, verify_threshold(cfg), BUCKET_WINDOW)]
    else:
        jobs.append(map_shards(_Partition(cfg, rows, pairs_dir, parts), partition,
                               rank_ledger(partition / RANKS_DIR, "kiln_dedup_partition", identity, [{}] * parts),
                               settings=executor, jobs=cfg.num_workers, job_name="kiln_dedup_partition",
                               outputs=[pairs_dir]))
        found = []
        for part in range(parts):
            with np.load(pairs_dir / f"{part:05d}.npz", allow_pickle=False) as arrays:
                found.append({name: arrays[name] for name in arrays.files})
    phase("partition")
    bands, band_rows = lsh_bands(cfg)
    decided = decide(rows, found, cfg.exact,
                     {"lsh": {"bands": bands, "rows": band_rows, "verify_threshold": verify_threshold(cfg)}})
    decisions = work / _DECISIONS
    decisions.mkdir(parents=True, exist_ok=True)
    for rank, removed in enumerate(decided.removed):
        (decisions / f"{rank:05d}.json").write_text(json.dumps([[p, *d] for p, d in sorted(removed.items())]))
    phase("cluster")
    writer = _WriteAndIndex(inputs, out_dir, decisions, signed=signed_dir, settings=settings)
    writing, written = write_decisions(writer, work / "write", executor, cfg.num_workers, config, draw=False)
    jobs.append(writing)
    phase("write")
    save_merged(out_dir / INDEX_DIR, settings, ([(index_rows, f"{INDEX_RANK:05d}")] if index_rows is not None else [])
                + [(signed_dir, f"{rank:05d}") for rank in range(len(inputs))])
    shutil.rmtree(work)
    phase("index")
    stats = {**written, **decided.stats, "executor_cpu_s": sum(job.outside_cpu_s for job in jobs)}
    if plots:
        draw_plots(stats, out_dir)
        phase("plot")
    return stats


def draw_plots(stats: dict[str, Any], out_dir: Path) -> None:
    """The fast engine's two figures, from its stats alone: removals by domain and reason
    (removals.png) and clusters by size (cluster_sizes.png)."""
    plot(stats["accounting"], out_dir / REPORT_PNG, "dedup")
    plot_cluster_sizes(Counter({int(size): num for size, num in stats["cluster_sizes"].items()}), out_dir / PLOT_FILE)
