"""The dedup stage on `cluster.executor`: signatures per shard in parallel, clusters in this process,
each shard's kept and removed documents written in parallel.

`dedup_documents` runs the fast engine's three steps (`tasks.data.dedup`): a shard job signs every
input shard (digests, MinHash signatures, ids, lengths, scores, snippets: no text); this process
loads those, finds the clusters and decides each document's fate, as one process must; a second
shard job writes the kept and removed shards from the decisions, tallying as it writes. The
output equals what one process reading the whole input would write. A rerun after a failure keeps
each rank a job finished while its key holds (the run ledger's: the settings and the content of
what the rank reads: its input shard, and for writing, its shard's decisions).
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

from kiln.tasks.data.dedup import (
    PLOT_FILE,
    DedupConfig,
    SignedShard,
    cluster,
    plot_cluster_sizes,
    sign_shard,
    signature_settings,
    write_shard,
)
from kiln.tasks.data.dedup_index import INDEX_DIR, DedupIndex
from kiln.tasks.data.executors import LOCAL, RANKS_DIR, ExecutorSettings, ShardRun, map_shards, rank_ledger
from kiln.tasks.data.inspection import REPORT_PNG, plot, write_removal_report
from kiln.tasks.data.shards import KINDS, RankShards
from kiln.tasks.store import recorded_sha256

WORK_DIR = "_dedup"  # the jobs' logs, markers, signatures and decisions, while the stage runs
_SIGNED = "signed"
_DECISIONS = "decisions"
_WRITE_FACTS = ("ids", "domains", "text_bytes", "canonical", "has_metadata")


@dataclass(frozen=True)
class _Sign:
    """Rank r: sign input shard r into `target/NNNNN.npz`."""

    cfg: DedupConfig
    shards: list[Path]
    target: Path

    def __call__(self, rank: int) -> dict[str, Any]:
        signed = sign_shard(self.cfg, self.shards[rank])
        self.target.mkdir(parents=True, exist_ok=True)
        signed.save(self.target / f"{rank:05d}.npz")
        return {"num_docs": len(signed.ids)}


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
    index = DedupIndex.empty(settings) if index_dir is None else DedupIndex.load(index_dir, settings)
    work = out_dir / WORK_DIR
    config = cfg.identity()

    phase_s = {} if phase_s is None else phase_s
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phase_s[name] = round(now - clock, 4)
        clock = now

    sign = work / "sign"
    signed_dir = sign / _SIGNED
    signing = map_shards(_Sign(cfg, inputs, signed_dir), sign,
                         rank_ledger(sign / RANKS_DIR, "kiln_dedup_sign", config, [{"shard": s} for s in inputs]),
                         settings=executor, jobs=cfg.num_workers, job_name="kiln_dedup_sign", outputs=[signed_dir])
    phase("sign")
    found = cluster(cfg, index, [SignedShard.load(signed_dir / f"{rank:05d}.npz") for rank in range(len(inputs))])
    decisions = work / _DECISIONS
    decisions.mkdir(parents=True, exist_ok=True)
    for rank, removed in enumerate(found.removed):
        (decisions / f"{rank:05d}.json").write_text(json.dumps([[p, *d] for p, d in sorted(removed.items())]))
    phase("cluster")
    writing, written = write_decisions(WriteDecisions(inputs, out_dir, decisions, signed=signed_dir), work / "write",
                                       executor, cfg.num_workers, config, draw=False)
    phase("write")
    found.index.save(out_dir / INDEX_DIR)
    shutil.rmtree(work)
    phase("index")
    stats = {**written, **found.stats, "executor_cpu_s": signing.outside_cpu_s + writing.outside_cpu_s}
    if plots:
        draw_plots(stats, out_dir)
        phase("plot")
    return stats


def draw_plots(stats: dict[str, Any], out_dir: Path) -> None:
    """The fast engine's two figures, from its stats alone: removals by domain and reason
    (removals.png) and clusters by size (cluster_sizes.png)."""
    plot(stats["accounting"], out_dir / REPORT_PNG, "dedup")
    plot_cluster_sizes(Counter({int(size): num for size, num in stats["cluster_sizes"].items()}), out_dir / PLOT_FILE)
