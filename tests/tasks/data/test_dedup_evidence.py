"""Evidence that the default dedup config does what it claims, measured on real documents.

The corpus (tests/fixtures/dedup_corpus.py) holds 120 man pages and Python sources, an exact copy
of each in other case and whitespace, and six edited copies of each whose true shingle Jaccard
similarity to the original is computed exactly. Claims: at least 98% of pairs with Jaccard
>= 0.85 end in one cluster; at most 1% of pairs below 0.5 do.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.shards import shard_paths
from tests.fixtures.dedup_corpus import build_corpus, clusters_from_output, score
from tests.fixtures.shards import records, write_stage


@pytest.fixture(scope="module")
def deduped(tmp_path_factory):
    corpus = build_corpus(num_bases=120, seed=0)
    work = tmp_path_factory.mktemp("evidence")
    out = work / "out"
    out.mkdir()
    # four shards, signed two at a time: the clusters span them
    stats = dedup_documents(DedupConfig(num_workers=2), shard_paths(write_stage(work / "in", corpus.docs, 4)), out)
    return corpus, stats, out


def test_recall_and_false_positive_rate_on_known_similarities(deduped):
    corpus, _, out = deduped
    result = score(corpus.pairs, clusters_from_output(out), duplicate=0.85, distinct=0.5)
    assert result.num_positive >= 450 and result.num_negative >= 7000  # enough pairs to mean something
    assert result.recall >= 0.98, result
    assert result.false_positive_rate <= 0.01, result
    # The pinned corpus gives exactly these (the pipeline is deterministic): 2 of 498 missed, at 0.86-0.87.
    assert (round(result.recall, 4), result.false_positive_rate) == (0.996, 0.0)


def test_every_case_and_whitespace_copy_is_caught_as_an_exact_duplicate(deduped):
    corpus, stats, out = deduped
    cluster_of = clusters_from_output(out)
    copies = [p for p in corpus.pairs if p.b.endswith("#exact")]
    assert len(copies) == 120 and all(cluster_of[p.a] == cluster_of[p.b] for p in copies)
    # One removal per copy, plus bundled man pages that are byte-identical under two names.
    assert stats["removed"]["exact_duplicate"] == 137


def test_stats_report_rates_histogram_samples_and_plot(deduped):
    corpus, stats, out = deduped
    domains = Counter(d.domain for d in corpus.docs)
    removed_by_domain = Counter(r["domain"] for r in records(out, "removed"))
    assert stats["duplicate_rate_by_domain"] == {d: removed_by_domain[d] / n for d, n in sorted(domains.items())}
    assert sum(stats["cluster_sizes"].values()) == stats["num_clusters"]
    assert sum(int(size) * n for size, n in stats["cluster_sizes"].items()) == stats["num_removed"] + stats["num_clusters"]
    texts = {d.id: d.text for d in corpus.docs}
    sample = stats["sample_clusters"]
    assert len(sample) == 5 and sample[0]["size"] == max(int(s) for s in stats["cluster_sizes"])
    for cluster in sample:
        assert cluster["members"][0]["id"] == cluster["survivor"]
        for member in cluster["members"]:
            assert member["snippet"] == texts[member["id"]][:100]
    assert (out / "cluster_sizes.png").stat().st_size > 1000
