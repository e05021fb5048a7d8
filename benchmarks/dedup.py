"""Dedup throughput and accuracy: Kiln's dedup stage and signatures against datasketch, same corpus, one core.

The corpus is built here from the whole bundled sample (`data/sample`): man pages (prose), Python
sources (code), translated man pages in 25 languages, Chinese and Japanese among them
(multilingual), and the HTML manuals' main text (web). Every base document gets an exact copy
that differs only in case and whitespace and edited copies (a share of its words replaced or
deleted at seeded positions), so the corpus is several times the sample's size and holds known
near duplicates; the bases' own duplicates (man pages that share most of their text) count too.

Truth: every pair with true Jaccard >= 0.8 on the stage's own shingles. Candidates are the injected
pairs, every pair any method put in one cluster, and every pair a low-threshold LSH (0.5, which
misses a pair at 0.8 with probability < 1e-6) proposes; each is scored on its exact shingle sets.
Recall is the share of true pairs a method puts in one cluster; precision the share of the pairs
it puts in one cluster (all pairs within each cluster) that are true pairs.

- stage:      `dedup_documents`, the whole stage as it runs in the pipeline on one worker: reading
              the corpus (one shard), signing, exact and fuzzy passes, writing kept and removed
              shards, the index, the removal report. Its two plots (removals.png, cluster_sizes.png),
              drawn from the stats alone, are drawn after the timed run and timed apart: the line
              "plots" gives their seconds and the ratio with them counted.
- signatures: read, normalise, `tasks.data.minhash` signatures (1000 documents a batch), banding,
              verification of candidates, union-find clusters: the same scope as datasketch below.
- datasketch: read, the same normalisation and shingles, then `MinHash(num_perm, seed).update_batch`
              per document and `MinHashLSH(threshold, num_perm, weights)` query and insert, every
              candidate a duplicate, union-find clusters: datasketch as its documentation uses it.
- rensa:      read, the same normalisation and shingles, then rensa's (Rust) `RMinHash(num_perm, seed).update`
              per document and `RMinHashLSH(threshold, num_perm, bands)` query and insert, as its
              README uses them (bands: the divisor of num_perm nearest the stage's band count,
              since rensa needs num_perm divisible by the bands: 16 of 8 rows at 128), each candidate
              verified with `jaccard` against the threshold, union-find clusters. rensa is a benchmark-only
              dependency (the `bench` extra: `make bench` installs it); without it the row is skipped.
- datatrove (`--datatrove`): `dedup_with_datatrove`, the four-stage local MinHash pipeline, one task.

Prints medians over `--repeats` runs (after an untimed warm-up run of each), documents/s, both
ratios (whole stage and signatures against datasketch) and the accuracy of each; last line
`RESULT dedup_stage_speedup <datasketch seconds / whole-stage seconds>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import lru_cache
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the cluster reader lives under tests/

import numpy as np  # noqa: E402
from datasketch import MinHash, MinHashLSH  # noqa: E402

from kiln.tasks.data import minhash  # noqa: E402
from kiln.tasks.data.dedup import DedupConfig, normalize, shingles  # noqa: E402
from kiln.tasks.data.dedup_job import dedup_documents, draw_plots  # noqa: E402
from kiln.tasks.data.documents import Document, parse_line, read_documents, read_lines, write_documents  # noqa: E402
from kiln.tasks.data.html_text import extract_html  # noqa: E402
from tests.fixtures.dedup_corpus import clusters_from_output  # noqa: E402

SAMPLE = REPO / "data" / "sample"
# Shares of a base's words edited, one copy each: true Jaccard about 0.95, 0.86 and 0.5 on 5-word
# shingles, clear of the 0.7-0.8 band where the configured threshold and the scored one disagree.
EDIT_FRACTIONS = (0.005, 0.015, 0.06)
TRUE_JACCARD = 0.8
MIN_WORDS = 30
# A method runs on (config, input file, output folder) and returns how to get its clusters afterwards:
# reading a stage's output back is the benchmark's check, not the stage's work, so it is not timed.
Method = Callable[[DedupConfig, Path, Path], Callable[[], dict[str, str]]]


def bundled_bases() -> list[Document]:
    """Every text of the bundled sample as one document, the four domains interleaved."""
    prose = [Document(f"prose/{p.relative_to(SAMPLE / 'prose')}", p.read_text(encoding="utf-8"), "man", "prose", "GPL")
             for p in sorted((SAMPLE / "prose").rglob("*.txt"))]

    def jsonl(path: Path, domain: str) -> list[Document]:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [Document(f"{domain}/{r['id']}", r["text"], r["source"], domain, r["licence"]) for r in rows]

    web = [Document(f"web/{p.relative_to(SAMPLE / 'web')}", extract_html(p.read_text(encoding="utf-8"))[0],
                    p.parent.name, "web", "GPL") for p in sorted((SAMPLE / "web").rglob("*.html"))]
    domains = [prose, jsonl(SAMPLE / "code" / "code.jsonl", "code"),
               jsonl(SAMPLE / "multilingual" / "multilingual.jsonl", "multilingual"), web]
    usable = [[d for d in docs if len(d.text.split()) >= MIN_WORDS] for docs in domains]
    longest = max(map(len, usable))
    return [docs[i] for i in range(longest) for docs in usable if i < len(docs)]


def corpus_bases(path: Path) -> list[Document]:
    """The documents of a JSON-lines file (`.jsonl`, or zstd-compressed `.jsonl.zst`): one record per line with a
    `text` string; `id`, `domain` and `metadata.quality_score` are used where present. Records without text
    are skipped (their count printed): this reads a corpus to time, not to clean."""
    bases, skipped = [], 0
    for number, line in enumerate(read_lines(path), 1):
        try:
            record = parse_line(line)
        except ValueError as error:
            sys.exit(f"{path}:{number}: not a JSON record ({error}); --corpus takes JSON lines with a 'text' field")
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            skipped += 1
            continue
        doc = Document(str(record.get("id", f"line-{number}")), text, path.name, str(record.get("domain", "web")),
                       "unknown")
        quality = (record.get("metadata") or {}).get("quality_score") if isinstance(record.get("metadata"), dict) else None
        if isinstance(quality, (int, float)):
            doc.metadata["quality_score"] = quality
        bases.append(doc)
    if skipped:
        print(f"{path}: {skipped} records without a 'text' string skipped")
    if not bases:
        sys.exit(f"{path}: no record with a 'text' string: nothing to deduplicate")
    return bases


def build_corpus(bases: list[Document], seed: int = 0, inject: bool = True
                 ) -> tuple[list[Document], list[tuple[str, str]]]:
    """The bases, their exact and edited copies (shuffled), and the injected (base, copy) pairs.
    Prose and web documents carry a quality score, as the clean stage leaves them."""
    rng = np.random.default_rng(seed)
    if not inject:
        return [bases[k] for k in rng.permutation(len(bases))], []
    vocabulary = sorted({w for d in bases for w in d.text.split()})
    docs: list[Document] = []
    pairs: list[tuple[str, str]] = []
    for base in bases:
        family = [base, Document(f"{base.id}#exact", base.text.upper().replace("\n", "\n\n  "), base.source,
                                 base.domain, base.licence)]
        words = base.text.split()
        for fraction in EDIT_FRACTIONS:
            edited: list[str | None] = list(words)
            for pos in rng.choice(len(words), size=max(1, round(fraction * len(words))), replace=False):
                edited[pos] = None if rng.random() < 0.5 else vocabulary[rng.integers(len(vocabulary))]
            family.append(Document(f"{base.id}#edit{fraction}", " ".join(w for w in edited if w is not None),
                                   base.source, base.domain, base.licence))
        for doc in family:
            if doc.domain in ("prose", "web") and "quality_score" not in doc.metadata:
                doc.metadata["quality_score"] = round(float(rng.random()), 4)
        docs += family
        pairs += [(base.id, copy.id) for copy in family[1:]]
    return [docs[k] for k in rng.permutation(len(docs))], pairs


class Truth:
    """Exact Jaccard similarity of document pairs on the stage's shingles."""

    def __init__(self, docs: list[Document], cfg: DedupConfig):
        self.texts = {d.id: d.text for d in docs}
        self.cfg = cfg
        self.similarity: dict[tuple[str, str], float] = {}

    @lru_cache(maxsize=4096)  # noqa: B019 — one Truth per run; the cache is the point
    def _set(self, doc_id: str) -> frozenset[bytes]:
        return frozenset(shingles(normalize(self.texts[doc_id], self.cfg), self.cfg.shingle_size))

    def add(self, pairs: list[tuple[str, str]]) -> None:
        for a, b in pairs:
            key = (a, b) if a < b else (b, a)
            if key not in self.similarity:
                x, y = self._set(a), self._set(b)
                self.similarity[key] = len(x & y) / len(x | y) if x | y else 1.0

    def positives(self) -> set[tuple[str, str]]:
        return {pair for pair, jaccard in self.similarity.items() if jaccard >= TRUE_JACCARD}


def lsh_candidates(docs: list[Document], cfg: DedupConfig, threshold: float) -> list[tuple[str, str]]:
    texts = [normalize(d.text, cfg) for d in docs]
    sigs = np.concatenate([minhash.signatures(texts[lo : lo + 1000], cfg.shingle_size, cfg.num_perm, cfg.seed,
                                              joined=True) for lo in range(0, len(texts), 1000)])
    pairs = minhash.candidate_pairs(minhash.band_keys(sigs, *minhash.lsh_params(threshold, cfg.num_perm)))
    return [(docs[a].id, docs[b].id) for a, b in pairs.tolist()]


def clustered_pairs(cluster_of: dict[str, str]) -> set[tuple[str, str]]:
    members: dict[str, list[str]] = {}
    for doc_id, root in cluster_of.items():
        members.setdefault(root, []).append(doc_id)
    return {(a, b) if a < b else (b, a) for group in members.values() for a, b in combinations(group, 2)}


STAGE_PHASES: list[dict[str, float]] = []  # each timed stage run's seconds by phase
PLOT_SECONDS: list[float] = []  # each stage run's plots, drawn after it


def run_stage(cfg: DedupConfig, input_file: Path, out_dir: Path) -> Callable[[], dict[str, str]]:
    phases: dict[str, float] = {}
    stats = dedup_documents(cfg, [input_file], out_dir, phase_s=phases, plots=False)
    STAGE_PHASES.append(phases)

    def clusters() -> dict[str, str]:  # called after the timed run: the plots, then the benchmark's check
        started = time.perf_counter()
        draw_plots(stats, out_dir)
        PLOT_SECONDS.append(time.perf_counter() - started)
        return clusters_from_output(out_dir)
    return clusters


def _union_find(ids: list[str], pairs: list[tuple[str, str]]) -> dict[str, str]:
    parent = {doc_id: doc_id for doc_id in ids}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    return {doc_id: find(doc_id) for doc_id in ids}


def run_signatures(cfg: DedupConfig, input_file: Path, out_dir: Path) -> Callable[[], dict[str, str]]:
    ids, sigs, batch = [], [], []
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
    cluster_of = _union_find(ids, [(ids[a], ids[b]) for a, b in pairs.tolist()])
    return lambda: cluster_of


def run_datasketch(cfg: DedupConfig, input_file: Path, out_dir: Path) -> Callable[[], dict[str, str]]:
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, weights=(cfg.fp_weight, cfg.fn_weight))
    ids, pairs = [], []
    for doc in read_documents(input_file):
        sketch = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        sketch.update_batch(shingles(normalize(doc.text, cfg), cfg.shingle_size))
        pairs += [(other, doc.id) for other in lsh.query(sketch)]
        lsh.insert(doc.id, sketch)
        ids.append(doc.id)
    cluster_of = _union_find(ids, pairs)
    return lambda: cluster_of


def run_rensa(cfg: DedupConfig, input_file: Path, out_dir: Path) -> Callable[[], dict[str, str]]:
    from rensa import RMinHash, RMinHashLSH

    stage_bands = minhash.lsh_params(cfg.threshold, cfg.num_perm, cfg.fp_weight, cfg.fn_weight)[0]
    bands = min((b for b in range(1, cfg.num_perm + 1) if cfg.num_perm % b == 0), key=lambda b: abs(b - stage_bands))
    lsh = RMinHashLSH(cfg.threshold, cfg.num_perm, bands)
    ids, sketches, pairs = [], [], []
    for node, doc in enumerate(read_documents(input_file)):
        sketch = RMinHash(cfg.num_perm, cfg.seed)
        sketch.update([s.decode("utf-8") for s in shingles(normalize(doc.text, cfg), cfg.shingle_size)])
        pairs += [(ids[other], doc.id) for other in lsh.query(sketch)
                  if sketches[other].jaccard(sketch) >= cfg.threshold]
        lsh.insert(node, sketch)
        ids.append(doc.id)
        sketches.append(sketch)
    cluster_of = _union_find(ids, pairs)
    return lambda: cluster_of


def run_datatrove(cfg: DedupConfig, input_file: Path, out_dir: Path) -> Callable[[], dict[str, str]]:
    from loguru import logger

    from kiln.tasks.data.dedup_datatrove import dedup_with_datatrove

    logger.remove()  # datatrove logs every stage's stats; the table below is the report
    dedup_with_datatrove(cfg, [input_file], out_dir, tasks=1)
    return lambda: clusters_from_output(out_dir)


def measure(methods: list[Method], cfg: DedupConfig, input_file: Path, work: Path, repeats: int
            ) -> dict[str, tuple[list[float], dict[str, str]]]:
    """Each method's seconds per repeat and its clusters; repeats interleaved, in rotating order, so
    that every method sees the same load over time, after one untimed run of each that pays its imports (matplotlib,
    scipy, datasketch's) and first-call costs, which are no part of the throughput per document."""
    for method in methods:
        out = work / f"{method.__name__}-warmup"
        out.mkdir()
        method(cfg, input_file, out)()  # ...and its check (the stage's plots: matplotlib's import)
    results: dict[str, tuple[list[float], dict[str, str]]] = {}
    for repeat in range(repeats):
        shift = repeat % len(methods)  # each method goes first in turn: none always runs on a cold cache
        for method in methods[shift:] + methods[:shift]:
            name = method.__name__.removeprefix("run_")
            out = work / f"{name}-{repeat}"
            out.mkdir()
            started = time.perf_counter()
            clusters = method(cfg, input_file, out)
            seconds = time.perf_counter() - started
            results.setdefault(name, ([], clusters()))[0].append(seconds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 1-2 minutes with the defaults on 2 cores (each "
                                            "repeat a few seconds per method; building the corpus first).")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each method; medians (default: 3)")
    parser.add_argument("--datatrove", action="store_true", help="also time datatrove's MinHash pipeline")
    parser.add_argument("--corpus", type=Path, help="a JSON-lines file of documents (a 'text' field each; .jsonl.zst "
                        "read too) to use as the bases (default: the bundled sample)")
    parser.add_argument("--as-is", action="store_true", help="with --corpus: time the corpus as it is, without "
                        "injected copies (its own duplicates are the truth's only positives; default: off)")
    args = parser.parse_args()

    cfg = DedupConfig()
    bases = corpus_bases(args.corpus) if args.corpus else bundled_bases()
    docs, injected = build_corpus(bases, inject=not args.as_is)
    num_docs = len(docs)
    methods: list[Method] = [run_stage, run_signatures, run_datasketch]
    try:
        import rensa  # noqa: F401 — a benchmark-only dependency
        methods.append(run_rensa)
    except ImportError:
        print("rensa is not installed (pip install -e '.[bench]', or make bench): its row is skipped")
    methods += [run_datatrove] if args.datatrove else []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        input_file = work / "corpus.jsonl"
        write_documents(input_file, docs)
        domains = sorted({d.domain for d in docs})
        print(f"corpus: {num_docs} documents ({', '.join(f'{sum(d.domain == x for d in docs)} {x}' for x in domains)}), "
              f"{input_file.stat().st_size / 1e6:.1f} MB, {len(injected)} injected copies; LSH "
              f"{minhash.lsh_params(cfg.threshold, cfg.num_perm, cfg.fp_weight, cfg.fn_weight)} (bands, rows) at "
              f"threshold {cfg.threshold}, {cfg.num_perm} permutations; medians of {args.repeats}; one core")
        runs = measure(methods, cfg, input_file, work, args.repeats)
    results = {name: (statistics.median(times), cluster_of) for name, (times, cluster_of) in runs.items()}
    normalized = [normalize(d.text, cfg) for d in docs]
    sig_times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for lo in range(0, num_docs, 1000):
            minhash.signatures(normalized[lo : lo + 1000], cfg.shingle_size, cfg.num_perm, cfg.seed, joined=True)
        fast = time.perf_counter() - started
        started = time.perf_counter()
        for text in normalized:
            MinHash(num_perm=cfg.num_perm, seed=cfg.seed).update_batch(shingles(text, cfg.shingle_size))
        sig_times.append((fast, time.perf_counter() - started))
    sig_fast, sig_datasketch = (statistics.median(t) for t in zip(*sig_times))

    truth = Truth(docs, cfg)
    truth.add(injected + lsh_candidates(docs, cfg, threshold=0.5))
    found = {name: clustered_pairs(cluster_of) for name, (_, cluster_of) in results.items()}
    for pairs in found.values():
        truth.add(sorted(pairs))
    positives = truth.positives()
    print(f"true pairs (Jaccard >= {TRUE_JACCARD}): {len(positives)}")
    print(f"{'method':<12}{'seconds':>9}{'docs/s/core':>13}{'pairs':>8}{f'recall>={TRUE_JACCARD}':>12}"
          f"{f'precision>={TRUE_JACCARD}':>15}   all runs (s)")
    for name, (seconds, _) in results.items():
        hits = len(found[name] & positives)
        precision = hits / len(found[name]) if found[name] else 1.0
        print(f"{name:<12}{seconds:>9.2f}{num_docs / seconds:>13.0f}{len(found[name]):>8}"
              f"{hits / len(positives):>12.4f}{precision:>15.4f}   {', '.join(f'{t:.2f}' for t in runs[name][0])}")
    datasketch = results["datasketch"][0]
    timed = STAGE_PHASES[-args.repeats :]  # the warm-up run's phases are not medians of the timed runs
    print("stage phases (median s): " + ", ".join(f"{name} {statistics.median(p[name] for p in timed):.3f}"
                                                  for name in timed[0]))
    plots = statistics.median(PLOT_SECONDS[-args.repeats :])
    print(f"plots (removals.png, cluster_sizes.png; drawn after each timed stage run): {plots:.3f} s; "
          f"the stage with them: {datasketch / (results['stage'][0] + plots):.2f}x datasketch")
    print(f"shingles + signatures of normalised text alone: Kiln {sig_fast:.2f} s, datasketch {sig_datasketch:.2f} s "
          f"({sig_datasketch / sig_fast:.1f}x)")
    print(f"RESULT dedup_signature_path_speedup {datasketch / results['signatures'][0]:.2f}")
    if "rensa" in results:
        print(f"RESULT dedup_stage_speedup_vs_rensa {results['rensa'][0] / results['stage'][0]:.2f}")
    if "datatrove" in results:
        print(f"RESULT dedup_stage_speedup_vs_datatrove {results['datatrove'][0] / results['stage'][0]:.2f}")
    print(f"RESULT dedup_stage_speedup {datasketch / results['stage'][0]:.2f}")


if __name__ == "__main__":
    main()
