"""Fuzzy dedup throughput and accuracy: Kiln's fast path against datasketch and datatrove, same corpus.

The corpus is `tests/fixtures/dedup_corpus.py` (bundled man pages and Python sources, exact
copies, and edited copies of exactly known Jaccard similarity), written once as JSON lines. Each
method reads that file, finds duplicates on one core and is scored on the known pairs:

- fast:       read, normalise, `tasks.data.minhash` signatures (1000 documents a batch), banding,
              verification of candidates, union-find clusters: the same scope as datasketch below.
- fast_stage: `dedup_documents`, the whole stage (adds the exact pass, and writes the outputs, the
              index and the plot), 1 worker.
- datasketch: the same normalisation and shingles, then `MinHash(num_perm, seed).update_batch`
              per document (default SHA-1 hashing) and `MinHashLSH(threshold, num_perm)` insert
              and query, every candidate a duplicate, union-find clusters.
- datatrove:  `tasks.data.dedup_datatrove.dedup_with_datatrove` (the four-stage local MinHash
              pipeline) with one task.

Prints medians over `--repeats` runs and the ratios; last line
`RESULT dedup_speedup_vs_datasketch <datasketch seconds / fast seconds>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the corpus builder lives under tests/

import numpy as np  # noqa: E402
from datasketch import MinHash, MinHashLSH  # noqa: E402

from tasks.data import minhash  # noqa: E402
from tasks.data.dedup import DedupConfig, dedup_documents, normalize, shingles  # noqa: E402
from tasks.data.documents import read_documents, write_documents  # noqa: E402
from tests.fixtures.dedup_corpus import Score, build_corpus, clusters_from_output, score  # noqa: E402

Method = Callable[[DedupConfig, Path, Path], dict[str, str]]


def run_fast(cfg: DedupConfig, input_file: Path, out_dir: Path) -> dict[str, str]:
    ids, sigs = [], []
    batch: list[str] = []
    for doc in read_documents(input_file):
        ids.append(doc.id)
        batch.append(normalize(doc.text, cfg))
        if len(batch) == 1000:
            sigs.append(minhash.signatures(batch, cfg.shingle_size, cfg.num_perm, cfg.seed, joined=True))
            batch = []
    sigs.append(minhash.signatures(batch, cfg.shingle_size, cfg.num_perm, cfg.seed, joined=True))
    signatures = np.concatenate(sigs)
    bands, rows = minhash.lsh_params(cfg.threshold, cfg.num_perm, cfg.fp_weight, cfg.fn_weight)
    pairs = minhash.candidate_pairs(minhash.band_keys(signatures, bands, rows))
    pairs = pairs[minhash.estimated_jaccard(signatures[pairs[:, 0]], signatures[pairs[:, 1]]) >= cfg.threshold]
    parent = list(range(len(ids)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    return {doc_id: ids[find(i)] for i, doc_id in enumerate(ids)}


def run_fast_stage(cfg: DedupConfig, input_file: Path, out_dir: Path) -> dict[str, str]:
    dedup_documents(cfg, input_file, out_dir)
    return clusters_from_output(out_dir)


def run_datasketch(cfg: DedupConfig, input_file: Path, out_dir: Path) -> dict[str, str]:
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, weights=(cfg.fp_weight, cfg.fn_weight))
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for doc in read_documents(input_file):
        sketch = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        sketch.update_batch(shingles(normalize(doc.text, cfg), cfg.shingle_size))
        parent[doc.id] = doc.id
        for other in lsh.query(sketch):
            a, b = find(other), find(doc.id)
            if a != b:
                parent[max(a, b)] = min(a, b)
        lsh.insert(doc.id, sketch)
    return {doc_id: find(doc_id) for doc_id in parent}


def run_datatrove(cfg: DedupConfig, input_file: Path, out_dir: Path) -> dict[str, str]:
    from loguru import logger

    from tasks.data.dedup_datatrove import dedup_with_datatrove

    logger.remove()  # datatrove logs every stage's stats; the table below is the report

    dedup_with_datatrove(cfg, input_file, out_dir, tasks=1)
    return clusters_from_output(out_dir)


def signature_seconds(cfg: DedupConfig, texts: list[str]) -> tuple[float, float]:
    """Seconds for the signatures alone of normalised texts: (fast path, datasketch per document)."""
    started = time.perf_counter()
    for lo in range(0, len(texts), 1000):
        minhash.signatures(texts[lo : lo + 1000], cfg.shingle_size, cfg.num_perm, cfg.seed, joined=True)
    fast = time.perf_counter() - started
    started = time.perf_counter()
    for text in texts:
        MinHash(num_perm=cfg.num_perm, seed=cfg.seed).update_batch(shingles(text, cfg.shingle_size))
    return fast, time.perf_counter() - started


def measure(method: Method, cfg: DedupConfig, input_file: Path, work: Path, repeats: int) -> tuple[float, Score]:
    times, result = [], None
    for repeat in range(repeats):
        out = work / f"{method.__name__}-{repeat}"
        out.mkdir()
        started = time.perf_counter()
        cluster_of = method(cfg, input_file, out)
        times.append(time.perf_counter() - started)
        result = result or cluster_of
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bases", type=int, default=450, help="real documents to copy and edit (8 docs each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-datatrove", action="store_true")
    args = parser.parse_args()

    cfg = DedupConfig()
    corpus = build_corpus(args.bases, seed=0, cfg=cfg)
    num_docs = len(corpus.docs)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        input_file = work / "corpus.jsonl"
        write_documents(input_file, corpus.docs)
        num_chars = sum(len(d.text) for d in corpus.docs)
        print(f"corpus: {num_docs} documents, {num_chars / 1e6:.1f} M characters, {len(corpus.pairs)} scored pairs; "
              f"LSH {minhash.lsh_params(cfg.threshold, cfg.num_perm, cfg.fp_weight, cfg.fn_weight)} "
              f"(bands, rows) at threshold {cfg.threshold}, {cfg.num_perm} permutations; medians of {args.repeats}")
        methods: list[Method] = [run_fast, run_fast_stage, run_datasketch]
        if not args.skip_datatrove:
            methods.append(run_datatrove)
        results = {}
        for method in methods:
            seconds, cluster_of = measure(method, cfg, input_file, work, args.repeats)
            results[method.__name__.removeprefix("run_")] = (seconds, score(corpus.pairs, cluster_of))
        normalized = [normalize(d.text, cfg) for d in corpus.docs]
        timings = [signature_seconds(cfg, normalized) for _ in range(args.repeats)]
        sig_fast, sig_datasketch = (statistics.median(t) for t in zip(*timings))

    fast_seconds = results["fast"][0]
    print(f"{'method':<12}{'seconds':>9}{'docs/s/core':>13}{'x fast':>8}{'recall>=.85':>13}{'FPR<.5':>9}{'precision':>11}")
    for name, (seconds, result) in results.items():
        print(f"{name:<12}{seconds:>9.2f}{num_docs / seconds:>13.0f}{seconds / fast_seconds:>8.2f}"
              f"{result.recall:>13.4f}{result.false_positive_rate:>9.4f}{result.precision:>11.4f}")
    print(f"shingles + signatures of normalised text alone: fast {sig_fast:.2f} s, datasketch {sig_datasketch:.2f} s "
          f"({sig_datasketch / sig_fast:.1f}x)")
    if "datatrove" in results:
        print(f"RESULT dedup_speedup_vs_datatrove {results['datatrove'][0] / fast_seconds:.2f}")
    print(f"RESULT dedup_speedup_vs_datasketch {results['datasketch'][0] / fast_seconds:.2f}")


if __name__ == "__main__":
    main()
