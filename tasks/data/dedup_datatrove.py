"""The dedup stage's distributed path: datatrove's four-stage MinHash pipeline on the configured executor.

The four pipelines run one after another through `tasks.data.executors` (local processes, Slurm
or Ray); each keeps its completion markers under `datatrove/logs/<stage>`, so a rerun after a
failure skips the finished stages and ranks.

The same `DedupConfig` as the single-node `dedup_documents` drives it: n-gram size, the LSH's
bands and rows (from `threshold` and `num_perm`), seed and the case/whitespace/punctuation
switches. The results are written in Kiln's format (`documents.jsonl` in input order,
`removed.jsonl` with reason `near_duplicate` and `metadata.duplicate_of`), so either path feeds
the next stage. Where the two paths differ, and why:

- Text simplification is datatrove's `simplify_text`, which also maps every number to "0" and
  strips diacritics, and turns punctuation into spaces (Kiln deletes it); words come from its
  spaCy English tokenizer, so unsegmented scripts (CJK) get no character n-grams here.
- A document sharing one whole band with another is a duplicate: datatrove does not check the
  estimated Jaccard afterwards, as `dedup_documents` does, so pairs just below `threshold` that
  collide in a band are removed here and kept there.
- There is no separate exact pass: exact copies share every band and are removed as near
  duplicates; a document with fewer words than `shingle_size` has no signature and is kept.
  So `exact`, `verify_threshold` and `num_workers` (here: `tasks`) have no effect on this path.

Datatrove decides the clusters; which member a cluster keeps follows the single-node rule
(quality score, then length, then id) rather than datatrove's union-find root, so where the two
paths find the same clusters they write the same files. Stage 4 therefore serves to label each
document id with its cluster (its own removals are only which members were not the root).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig

from tasks.accounting import DocCounts
from tasks.data.dedup import DedupConfig, lsh_bands, quality_score, survivor_rank
from tasks.data.documents import DOCUMENTS_FILE, REMOVED_FILE, ReasonLog, read_documents
from tasks.data.executors import LOCAL, PLAN_FILE, ExecutorSettings, keep_or_reset, run_pipeline
from tasks.data.inspection import RemovalTally, text_bytes, write_removal_report
from tasks.errors import ConfigError, InputError

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


def _from_kiln(self: JsonlReader, data: dict, path: str, id_in_file: int | str) -> dict:
    """Reader adapter: only the Kiln id and text enter datatrove; Kiln writes full records itself."""
    return {"id": data["id"], "text": data["text"], "metadata": {}}


def _ids_only(self: JsonlWriter, document: Any) -> dict:
    """Writer adapter: which document, and its duplicate cluster (-1: in none)."""
    return {"id": document.id, "cluster": document.metadata.get("minhash_cluster_id", -1)}


def build_pipelines(cfg: DedupConfig, work: Path) -> dict[str, list]:
    """The four datatrove pipelines, by stage name, reading shards from `work/input`."""
    config = minhash_config(cfg)

    def reader() -> JsonlReader:
        return JsonlReader(str(work / "input"), compression=None, adapter=_from_kiln, glob_pattern="*.jsonl")

    return {
        "signatures": [reader(), MinhashDedupSignature(str(work / "signatures"), config=config)],
        "buckets": [MinhashDedupBuckets(str(work / "signatures"), str(work / "buckets"), config=config)],
        "clusters": [
            MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config, save_cluster_id=True)
        ],
        "filter": [
            reader(),
            MinhashDedupFilter(
                str(work / "remove"),
                exclusion_writer=JsonlWriter(str(work / "removed"), compression=None, adapter=_ids_only),
                load_cluster_ids=True,
            ),
            JsonlWriter(str(work / "kept"), compression=None, adapter=_ids_only),
        ],
    }


def stage_tasks(cfg: DedupConfig, tasks: int) -> dict[str, int]:
    """Ranks per pipeline: stage 2 runs one per LSH band (bucket), stage 3 must run as one."""
    return {"signatures": tasks, "buckets": minhash_config(cfg).num_buckets, "clusters": 1, "filter": tasks}


def dedup_with_datatrove(
    cfg: DedupConfig, input_file: Path, out_dir: Path, *, tasks: int = 2, executor: ExecutorSettings = LOCAL,
) -> dict:
    """Remove near duplicates from `input_file` with datatrove's MinHash in `tasks` tasks on `executor`."""
    if not cfg.fuzzy:
        raise ConfigError("dedup.fuzzy is false, but the datatrove path is MinHash (fuzzy) dedup only: "
                          "use the single-node dedup or set dedup.fuzzy: true")
    if tasks < 1:
        raise ConfigError(f"dedup datatrove tasks={tasks}: need at least 1 task")
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    input_file, out_dir = input_file.resolve(), out_dir.resolve()
    work = out_dir / WORK_DIR
    (out_dir / REMOVED_FILE).unlink(missing_ok=True)  # written lazily: a stale one must not survive a rerun
    plan = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)  # finished ranks are reused only under it
    num_in = keep_or_reset(work, "input", plan, lambda shards: _write_shards(input_file, shards, tasks))
    pipelines = build_pipelines(cfg, work)
    for stage, num_tasks in stage_tasks(cfg, tasks).items():
        run_pipeline(pipelines[stage], work / "logs" / stage, tasks=num_tasks, jobs=tasks, settings=executor,
                     job_name=f"kiln_dedup_{stage}")
    cluster_of = _read_clusters(work / "kept") | _read_clusters(work / "removed")
    assert len(cluster_of) == num_in, (len(cluster_of), num_in)
    survivor_of_cluster = _survivors(input_file, cluster_of)

    counts = DocCounts(num_in=num_in)
    domains: Counter[str] = Counter()
    removed_by_domain: Counter[str] = Counter()
    clusters: dict[int, list[str]] = defaultdict(list)
    tally = RemovalTally()
    with (
        open(out_dir / DOCUMENTS_FILE, "wb") as out,
        ReasonLog(out_dir / REMOVED_FILE) as removed_log,
    ):
        for doc in read_documents(input_file):
            domains[doc.domain] += 1
            cluster = cluster_of[doc.id]
            if cluster != -1:
                clusters[cluster].append(doc.id)
            if cluster == -1 or survivor_of_cluster[cluster] == doc.id:
                out.write(doc.to_json_line())
                counts.num_kept += 1
                tally.add("kept", doc.domain, text_bytes(doc.text))
                continue
            doc.metadata["duplicate_of"] = survivor_of_cluster[cluster]
            removed_log.add(_REASON, vars(doc))
            counts.removed[_REASON] += 1
            removed_by_domain[doc.domain] += 1
            tally.add("removed", doc.domain, text_bytes(doc.text), _REASON)
    for stage in ("input", "signatures", "buckets", "remove", "kept", "removed"):
        shutil.rmtree(work / stage, ignore_errors=True)
    (work / PLAN_FILE).unlink()  # without its shards it resumes nothing

    bands, rows = lsh_bands(cfg)
    dup_clusters = sorted(clusters.items(), key=lambda item: (-len(item[1]), item[1][0]))
    table = write_removal_report(out_dir, "dedup", tally.table())  # removals by domain and reason
    return {
        **counts.as_dict(),
        "accounting": table,
        "num_clusters": len(dup_clusters),
        "duplicate_rate_by_domain": {d: removed_by_domain[d] / total for d, total in sorted(domains.items())},
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
    }


def _write_shards(input_file: Path, shard_dir: Path, tasks: int) -> int:
    """Split the input into `tasks` contiguous shards (rank r reads shard r); returns the document count.

    Ids must be unique: datatrove's results are matched back to documents by id.
    """
    with open(input_file, encoding="utf-8") as handle:
        num_docs = sum(1 for line in handle if line.strip())
    per_shard = max(1, math.ceil(num_docs / tasks))
    shard_dir.mkdir(parents=True)
    shards = [open(shard_dir / f"{rank:05d}.jsonl", "wb") for rank in range(tasks)]
    seen: set[str] = set()
    try:
        for i, doc in enumerate(read_documents(input_file)):
            if doc.id in seen:
                raise InputError(f"{input_file}: document id {doc.id!r} occurs twice; ids must be unique for dedup")
            seen.add(doc.id)
            shards[i // per_shard].write(doc.to_json_line())
    finally:
        for shard in shards:
            shard.close()
    return num_docs


def _read_clusters(folder: Path) -> dict[str, int]:
    """`{doc id: cluster id}` from the JSON lines a stage-4 writer left in `folder` (none: empty)."""
    ids: dict[str, int] = {}
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                ids[record["id"]] = record["cluster"]
    return ids


def _survivors(input_file: Path, cluster_of: dict[str, int]) -> dict[int, str]:
    """The document each cluster keeps, by the single-node rule: highest `metadata.quality_score`
    (none ranks last), then the longest text, then the smallest id."""
    best: dict[int, tuple[tuple[bool, float, int, str], str]] = {}
    for doc in read_documents(input_file):
        cluster = cluster_of[doc.id]
        if cluster == -1:
            continue
        rank = survivor_rank(quality_score(doc), len(doc.text), doc.id)
        if cluster not in best or rank < best[cluster][0]:
            best[cluster] = (rank, doc.id)
    return {cluster: doc_id for cluster, (_, doc_id) in best.items()}
