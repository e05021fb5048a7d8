"""The datatrove MinHash path agrees with the single-node dedup on real text (its Slurm and Ray runs:
tests/tasks/data/test_executors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.data.dedup import DedupConfig, lsh_bands, normalize
from kiln.tasks.data.dedup_datatrove import STAGES, dedup_with_datatrove, minhash_config, stage_tasks
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.documents import Document
from kiln.tasks.data.executors import RANKS_DIR
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.ledger import RankRecords
from tests.fixtures.shards import records, write_stage

COREUTILS = Path(__file__).parents[3] / "data" / "sample" / "prose" / "coreutils-man"
NUM_EDITS = 3
MIN_WORDS = 300


def _corpus() -> tuple[list[Document], dict[str, str]]:
    """coreutils' man pages (which hold natural near-duplicates: ls/dir/vdir, the sha*sum family),
    plus an edited copy of every other page of at least MIN_WORDS words: NUM_EDITS words replaced,
    which changes at most NUM_EDITS * 5 of its 5-grams, so Jaccard stays above 0.9."""
    docs = [
        Document(f"coreutils/{path.stem}", path.read_text(encoding="utf-8"), "coreutils", "prose", "GPL-3.0-or-later")
        for path in sorted(COREUTILS.glob("*.txt"))
    ]
    planted: dict[str, str] = {}
    for doc in docs[::2]:
        if len(doc.text.split()) < MIN_WORDS:
            continue
        words = doc.text.split(" ")
        for k in range(1, NUM_EDITS + 1):
            words[k * len(words) // (NUM_EDITS + 1)] = "edited"
        planted[f"{doc.id}#edit"] = doc.id
        docs.append(Document(f"{doc.id}#edit", " ".join(words), doc.source, doc.domain, doc.licence))
    return docs, planted


def _removed(out: Path) -> dict[str, str]:
    removed = records(out, "removed")
    assert {r["reason"] for r in removed} <= {"near_duplicate", "exact_duplicate"}
    return {r["id"]: r["metadata"]["duplicate_of"] for r in removed}


def _jaccard(a: str, b: str, cfg: DedupConfig) -> float:
    def grams(text: str) -> set[str]:
        words = normalize(text, cfg).split()
        return {" ".join(words[i : i + cfg.shingle_size]) for i in range(len(words) - cfg.shingle_size + 1)}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def test_local_multi_task_datatrove_removes_what_the_single_node_dedup_removes(tmp_path):
    docs, planted = _corpus()
    assert (len(docs), len(planted)) == (129, 23)
    texts = {d.id: d.text for d in docs}
    cfg = DedupConfig()
    assert min(_jaccard(texts[copy], texts[original], cfg) for copy, original in planted.items()) > 0.9
    inputs = shard_paths(write_stage(tmp_path / "in", docs, 3))  # three shards, two tasks
    (tmp_path / "single").mkdir()
    (tmp_path / "datatrove").mkdir()
    dedup_documents(cfg, inputs, tmp_path / "single")
    stats = dedup_with_datatrove(cfg, inputs, tmp_path / "datatrove", tasks=2)
    single, distributed = _removed(tmp_path / "single"), _removed(tmp_path / "datatrove")

    # Kiln's format: kept documents in input order, every document accounted for.
    kept = [record["id"] for record in records(tmp_path / "datatrove")]
    assert kept == [d.id for d in docs if d.id not in distributed]
    assert stats["num_in"] == 129 and stats["num_kept"] + stats["num_removed"] == 129
    assert stats["removed"] == {"near_duplicate": len(distributed)}
    assert stats["lsh"] == {"bands": 14, "rows": 9, "n_grams": 5} and lsh_bands(cfg) == (14, 9)
    assert sorted(p.name for p in (tmp_path / "datatrove" / "datatrove").iterdir()) == ["logs"]

    # Both paths put each planted pair (Jaccard > 0.9) in one cluster.
    single_clusters, distributed_clusters = _clusters(single), _clusters(distributed)
    for copy, original in planted.items():
        for clusters in (single_clusters, distributed_clusters):
            assert original in clusters.get(copy, ()), copy
    # Where both paths find the same cluster they keep and remove the same documents (one survivor rule).
    same = set(single_clusters.values()) & set(distributed_clusters.values())
    for member in set().union(*same):
        assert single.get(member) == distributed.get(member), member

    # Tolerance: datatrove counts a pair sharing one band as duplicates with no Jaccard check
    # (and hashes and simplifies text its own way); the single node also checks the estimated
    # Jaccard against the threshold (0.7). So datatrove's clusters are unions of single-node
    # clusters, and the extra unions are across borderline pairs: no two documents it joined that
    # the single node kept apart reach 0.8 Jaccard. On this corpus that is the md5sum/sha*sum
    # family (0.66-0.79) and yes/whoami (0.42): 3 of 32 removals differ.
    for cluster in set(single_clusters.values()):
        assert any(cluster <= other for other in distributed_clusters.values()), sorted(cluster)
    for cluster in set(distributed_clusters.values()) - set(single_clusters.values()):
        parts = {single_clusters.get(doc_id, frozenset([doc_id])) for doc_id in cluster}
        cross = [_jaccard(texts[a], texts[b], cfg) for p in parts for q in parts if p != q for a in p for b in q]
        assert max(cross) < 0.8, sorted(cluster)
    assert len(set(single) ^ set(distributed)) <= 0.1 * len(single)


def _clusters(removed: dict[str, str]) -> dict[str, frozenset[str]]:
    """Each clustered document's cluster (survivor plus the documents removed as its duplicates)."""
    members: dict[str, set[str]] = {}
    for doc_id, survivor in removed.items():
        members.setdefault(survivor, {survivor}).add(doc_id)
    return {doc_id: frozenset(cluster) for cluster in members.values() for doc_id in cluster}


def test_minhash_config_follows_the_dedup_config():
    cfg = DedupConfig(shingle_size=7, num_perm=64, threshold=0.85, seed=3, normalize_case=False)
    config = minhash_config(cfg)
    assert (config.n_grams, config.seed) == (7, 3)
    assert (config.num_buckets, config.hashes_per_bucket) == lsh_bands(cfg)
    assert config.norm_config.lowercase is False and config.norm_config.remove_punctuation is True
    assert (config.hash_config.hash_fc, config.hash_config.precision) == ("xxhash", 64)


def test_each_stage_runs_its_own_number_of_ranks():
    # stage 2 one rank per LSH band, stage 3 a single rank
    assert stage_tasks(DedupConfig(), 3) == {"signatures": 3, "buckets": 14, "clusters": 1, "filter": 3}
    assert list(stage_tasks(DedupConfig(), 3)) == list(STAGES)


def test_bad_settings_and_input_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="at least 1 task"):
        dedup_with_datatrove(DedupConfig(), [tmp_path / "in.jsonl"], tmp_path, tasks=0)
    with pytest.raises(ConfigError, match="dedup.fuzzy is false"):
        dedup_with_datatrove(DedupConfig(fuzzy=False), [tmp_path / "in.jsonl"], tmp_path)
    doc = Document("twice", " ".join(["word"] * 50), "s", "prose", "MIT")
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="document id 'twice' occurs twice"):
        dedup_with_datatrove(DedupConfig(), shard_paths(write_stage(tmp_path / "in", [doc, doc])), tmp_path / "out")


def test_an_attempt_under_other_settings_leaves_nothing_the_rerun_reads(tmp_path):
    """Every datatrove stage reads what all ranks of the one before wrote, so a rank recorded under another
    key (here: an attempt with three tasks, killed after signing) makes every intermediate stale: the
    rerun starts from nothing, and gives what a fresh run gives."""
    docs, _ = _corpus()
    inputs = shard_paths(write_stage(tmp_path / "in", docs[:60], 3))
    for name in ("fresh", "rerun"):
        (tmp_path / name).mkdir()
    dedup_with_datatrove(DedupConfig(), inputs, tmp_path / "fresh", tasks=2)
    work = tmp_path / "rerun" / "datatrove"
    RankRecords(work / RANKS_DIR / "signatures").put(2, "key-under-three-tasks", {"result": {}})
    stale = work / "signatures" / "bucket_000" / "00002.minhash.sig"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\xff" * 64)  # read by the buckets stage were it kept
    dedup_with_datatrove(DedupConfig(), inputs, tmp_path / "rerun", tasks=2)
    for kind in ("documents", "removed"):
        assert records(tmp_path / "rerun", kind) == records(tmp_path / "fresh", kind)
    assert not stale.exists()
