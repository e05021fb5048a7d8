"""The dedup stage's distributed path: datatrove's four-stage MinHash pipeline on the configured executor.

The four pipelines run one after another through `tasks.data.executors` (local processes, Slurm
or Ray); each rank of each records itself in the run ledger (`datatrove/ranks/<stage>`), so a rerun
after a failure skips the finished stages and ranks. Their intermediate files are shared by every
rank of the next stage, so a rank whose key changed (the settings, the tasks, any input shard's
content) makes them all stale: the rerun starts from nothing.

The same `DedupConfig` as the fast engine (`tasks.data.dedup_job.dedup_documents`) drives it:
n-gram size, the LSH's bands and rows (from `threshold` and `num_perm`), seed and the
case/whitespace/punctuation switches. Stages 1 and 4 read the input shards with Kiln's reader
(`ShardDocuments`: rank r reads shards r, r + tasks, ..., as datatrove's readers share files); stage 4
writes only each document's id, cluster, score and length, from which this process picks the
survivors, and the fast engine's `WriteDecisions` job writes Kiln's shards (kept in input order,
removed with reason `near_duplicate` and `metadata.duplicate_of`), so either path feeds the next
stage. Where the two paths differ, and why:

- Text simplification is datatrove's `simplify_text`, which also maps every number to "0" and
  strips diacritics, and turns punctuation into spaces (Kiln deletes it); words come from its
  spaCy English tokenizer, so unsegmented scripts (CJK) get no character n-grams here.
- A document sharing one whole band with another is a duplicate: datatrove does not check the
  estimated Jaccard afterwards, as `dedup_documents` does, so pairs just below `threshold` that
  collide in a band are removed here and kept there.
- There is no separate exact pass: exact copies share every band and are removed as near
  duplicates; a document with fewer words than `shingle_size` has no signature and is kept.
  So `exact`, `verify_threshold` and `num_workers` (here: `tasks`) have no effect on this path.
- Ids must be unique (datatrove's results are matched back to documents by id). A document without
  text is not read (datatrove's readers skip it too): it has no signature and is kept.

Datatrove decides the clusters; which member a cluster keeps follows the single-node rule
(quality score, then length, then id) rather than datatrove's union-find root, so where the two
paths find the same clusters they write the same files. Stage 4 therefore serves to label each
document id with its cluster (its own removals are only which members were not the root).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from datatrove.data import Document as DtDocument
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.typeshelper import StatHints

from kiln.tasks.data.dedup import DedupConfig, lsh_bands, quality_score, survivor_rank
from kiln.tasks.data.dedup_job import WriteDecisions, write_decisions
from kiln.tasks.data.documents import Document, read_lines, read_records
from kiln.tasks.data.executors import (
    LOCAL,
    RANKS_DIR,
    ExecutorSettings,
    RankLedger,
    RecordRank,
    rank_ledger,
    run_pipeline,
)
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.store import recorded_sha256

WORK_DIR = "datatrove"  # intermediates under out_dir; only its `logs/` (stats per stage) is kept
STAGES = ("signatures", "buckets", "clusters", "filter")
_REASON = "near_duplicate"
_NUM_SAMPLE_CLUSTERS = 5


def minhash_config(cfg: DedupConfig) -> MinhashConfig:
    """datatrove's MinHash settings for a Kiln `DedupConfig` (the same bands and rows as the single-node LSH)."""
    bands, rows = lsh_bands(cfg)
    return MinhashConfig(
        n_grams=cfg.shingle_size,
        num_buckets=bands,
        hashes_per_bucket=rows,
        seed=cfg.seed,
        norm_config=TextNormConfig(
            lowercase=cfg.normalize_case,
            norm_whitespace=cfg.normalize_whitespace,
            remove_punctuation=cfg.normalize_punctuation,
        ),
        # xxhash (datatrove's default) needs xxhash<4, which the project pins.
        hash_config=HashConfig(precision=64, hash_fc="xxhash"),
    )


class ShardDocuments(PipelineStep):
    """Rank r of `world_size` reads the input shards r, r + world_size, ... (as datatrove's readers share
    files out): each document's Kiln id and text, with what choosing a survivor needs (the score, the
    length) and where it is; Kiln writes full records itself. Stages 1 and 4 must read the same stream
    per rank: stage 4 finds the documents stage 3 removes by their position in it."""

    name = "📖 Kiln shards"
    type = "📖 - READER"

    def __init__(self, shards: list[Path]):
        super().__init__()
        self.shards = shards

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
        for path in self.shards[rank::world_size]:
            for line_number, line in enumerate(read_lines(path)):
                doc = Document.from_line(line)
                if not doc.text:
                    continue
                self.stat_update(StatHints.total)
                yield DtDocument(text=doc.text, id=doc.id, metadata={
                    "quality": quality_score(doc), "length": len(doc.text),
                    "where": {"file": path.name, "line": line_number}})


def _ids_only(self: JsonlWriter, document: Any) -> dict:
    """Writer adapter: which document, its duplicate cluster (-1: in none), score, length and place."""
    return {"id": document.id, "cluster": document.metadata.get("minhash_cluster_id", -1),
            **{key: document.metadata[key] for key in ("quality", "length", "where")}}


def build_pipelines(cfg: DedupConfig, inputs: list[Path], work: Path, ledgers: dict[str, RankLedger]) -> dict[str, list]:
    """The four datatrove pipelines, by stage name, reading the shards `inputs`, each ending in its rank's record."""
    config = minhash_config(cfg)
    pipelines = {
        "signatures": [ShardDocuments(inputs), MinhashDedupSignature(str(work / "signatures"), config=config)],
        "buckets": [MinhashDedupBuckets(str(work / "signatures"), str(work / "buckets"), config=config)],
        "clusters": [
            MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config, save_cluster_id=True)
        ],
        "filter": [
            ShardDocuments(inputs),
            MinhashDedupFilter(
                str(work / "remove"),
                exclusion_writer=JsonlWriter(str(work / "removed"), compression=None, adapter=_ids_only),
                load_cluster_ids=True,
            ),
            JsonlWriter(str(work / "kept"), compression=None, adapter=_ids_only),
        ],
    }
    return {stage: [*steps, RecordRank(ledgers[stage], os.getpid())] for stage, steps in pipelines.items()}


def stage_tasks(cfg: DedupConfig, tasks: int) -> dict[str, int]:
    """Ranks per pipeline: stage 2 runs one per LSH band (bucket), stage 3 must run as one."""
    return {"signatures": tasks, "buckets": minhash_config(cfg).num_buckets, "clusters": 1, "filter": tasks}


def dedup_with_datatrove(
    cfg: DedupConfig, inputs: list[Path], out_dir: Path, *, tasks: int = 2, executor: ExecutorSettings = LOCAL,
) -> dict:
    """Remove near duplicates from the shards `inputs` with datatrove's MinHash in `tasks` tasks on `executor`."""
    if not cfg.fuzzy:
        raise ConfigError("dedup.fuzzy is false, but the datatrove path is MinHash (fuzzy) dedup only: "
                          "use the single-node dedup or set dedup.fuzzy: true")
    if tasks < 1:
        raise ConfigError(f"dedup datatrove tasks={tasks}: need at least 1 task")
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    inputs, out_dir = [path.resolve() for path in inputs], out_dir.resolve()
    work = out_dir / WORK_DIR
    config = cfg.identity()
    # every rank of every stage depends on every input shard (through the stages before it)
    settings = {"config": config, "tasks": tasks, "inputs": [recorded_sha256(path) for path in inputs]}
    ledgers = {stage: rank_ledger(work / RANKS_DIR / stage, f"kiln_dedup_{stage}", settings, [{}] * num_tasks)
               for stage, num_tasks in stage_tasks(cfg, tasks).items()}
    if any(ledger.stale() for ledger in ledgers.values()):  # another run's intermediates: none may be reused
        shutil.rmtree(work)
    if inputs:
        pipelines = build_pipelines(cfg, inputs, work, ledgers)
        for stage, num_tasks in stage_tasks(cfg, tasks).items():
            run_pipeline(pipelines[stage], work / "logs" / stage, tasks=num_tasks, jobs=tasks, settings=executor,
                         job_name=f"kiln_dedup_{stage}", ledger=ledgers[stage])
    records = _read_records(work / "kept") + _read_records(work / "removed")
    cluster_of = {r["id"]: r["cluster"] for r in records}
    if len(cluster_of) < len(records):
        repeated = next(doc_id for doc_id, n in Counter(r["id"] for r in records).items() if n > 1)
        raise InputError(f"dedup (datatrove engine): document id {repeated!r} occurs twice; ids must be unique")
    order = {path.name: i for i, path in enumerate(inputs)}
    records.sort(key=lambda r: (order[r["where"]["file"]], r["where"]["line"]))  # input order
    survivor_of_cluster = _survivors(records)
    clusters: dict[int, list[str]] = defaultdict(list)
    removed: dict[str, tuple[str, str]] = {}
    for record in records:
        cluster = record["cluster"]
        if cluster == -1:
            continue
        clusters[cluster].append(record["id"])
        if survivor_of_cluster[cluster] != record["id"]:
            removed[record["id"]] = (_REASON, survivor_of_cluster[cluster])
    decisions = work / "decisions"
    decisions.mkdir(exist_ok=True)
    (decisions / "all.json").write_text(json.dumps(removed))
    writing, written = write_decisions(WriteDecisions(inputs, out_dir, decisions, by_id=True), work / "write",
                                       executor, tasks, config)
    for stage in ("signatures", "buckets", "remove", "kept", "removed", "decisions", "write", RANKS_DIR):
        shutil.rmtree(work / stage, ignore_errors=True)

    bands, rows = lsh_bands(cfg)
    dup_clusters = sorted(clusters.items(), key=lambda item: (-len(item[1]), item[1][0]))
    return {
        **written,
        "num_clusters": len(dup_clusters),
        "cluster_sizes": {
            str(size): num for size, num in sorted(Counter(len(m) for _, m in dup_clusters).items())
        },
        "sample_clusters": [
            {"survivor": survivor_of_cluster[c], "members": members[:10], "size": len(members)}
            for c, members in dup_clusters[:_NUM_SAMPLE_CLUSTERS]
        ],
        "executor": executor.kind,
        "tasks": tasks,
        "lsh": {"bands": bands, "rows": rows, "n_grams": cfg.shingle_size},
        "datatrove_logs": f"{WORK_DIR}/logs",
        "executor_cpu_s": writing.outside_cpu_s,
    }


def _read_records(folder: Path) -> list[dict[str, Any]]:
    """The records a stage-4 writer left in `folder` (none: empty)."""
    return [record for path in sorted(folder.glob("*.jsonl")) for record in read_records(path)]


def _survivors(records: list[dict[str, Any]]) -> dict[int, str]:
    """The document each cluster keeps, by the single-node rule: highest `metadata.quality_score`
    (none ranks last), then the longest text, then the smallest id."""
    best: dict[int, tuple[tuple[bool, float, int, str], str]] = {}
    for record in records:
        cluster = record["cluster"]
        if cluster == -1:
            continue
        quality = math.nan if record["quality"] is None else record["quality"]  # JSON writes NaN as null
        rank = survivor_rank(quality, record["length"], record["id"])
        if cluster not in best or rank < best[cluster][0]:
            best[cluster] = (rank, record["id"])
    return {cluster: doc_id for cluster, (_, doc_id) in best.items()}
