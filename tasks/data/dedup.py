"""The dedup stage on one node: exact (normalised-text hash), then fuzzy (MinHash LSH) duplicates.

Each cluster of duplicates keeps one document, chosen deterministically: the longest text, then
the earliest in the input. The others go to `removed.jsonl` with `metadata.duplicate_of` naming
the survivor. Output keeps input order, so reruns and worker counts never change it.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import re
import unicodedata
from collections import Counter, defaultdict
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH
from pydantic import Field

from tasks.accounting import DocCounts
from tasks.configbase import Section, runtime_field
from tasks.data.documents import DOCUMENTS_FILE, REMOVED_FILE, ReasonLog, read_documents

# datasketch 2.0's default; named so that signatures and the LSH agree (schemes must not mix).
_SCHEME = "affine32"
_BATCH = 1000  # documents per MinHash.bulk call: amortises its setup, bounds memory per worker
_NUM_SAMPLE_CLUSTERS = 5
_WHITESPACE = re.compile(r"\s+")
# Mean "word" length above which text is treated as unsegmented (Chinese, Japanese, Thai):
# spaced languages average 4-8 characters a word.
_UNSEGMENTED_WORD_LEN = 12


class DedupConfig(Section):
    exact: bool = True
    fuzzy: bool = True
    # Unicode NFKC is always applied; these make copies that differ only in form count as exact.
    normalize_case: bool = True
    normalize_whitespace: bool = True
    normalize_punctuation: bool = True
    # Word n-grams; character n-grams for unsegmented scripts (CJK) and texts of few words.
    shingle_size: int = Field(5, ge=1)
    num_perm: int = Field(128, ge=2)
    # Estimated Jaccard similarity at which two documents are duplicates. MinHashLSH picks its
    # bands for this value, and recalls few pairs much below it (see LIBRARY-NOTES).
    threshold: float = Field(0.8, gt=0.0, le=1.0)
    seed: int = 1
    num_workers: int = runtime_field(1, ge=1)


class _PunctuationTable(dict[int, int | None]):
    """A `str.translate` table deleting Unicode punctuation (categories P*), filled as characters
    are met: translate() is far faster than testing each character's category."""

    def __missing__(self, codepoint: int) -> int | None:
        value = None if unicodedata.category(chr(codepoint)).startswith("P") else codepoint
        self[codepoint] = value
        return value


_PUNCTUATION = _PunctuationTable()


def strip_punctuation(text: str) -> str:
    return text.translate(_PUNCTUATION)


def normalize(text: str, cfg: DedupConfig) -> str:
    text = unicodedata.normalize("NFKC", text)
    if cfg.normalize_case:
        text = text.casefold()
    if cfg.normalize_punctuation:
        text = strip_punctuation(text)
    if cfg.normalize_whitespace:
        text = _WHITESPACE.sub(" ", text).strip()
    return text


def shingles(normalized: str, size: int) -> list[bytes]:
    """Distinct word n-grams, or character n-grams when words are too few or unsegmented."""
    words = normalized.split()
    if len(words) >= size and len(normalized) / len(words) <= _UNSEGMENTED_WORD_LEN:
        grams = {" ".join(words[i : i + size]) for i in range(len(words) - size + 1)}
    else:
        chars = " ".join(words)
        grams = {chars[i : i + size] for i in range(max(1, len(chars) - size + 1))} if chars else set()
    return [gram.encode("utf-8") for gram in grams]  # any order: a MinHash is order-free


def _signatures(batch: list[list[bytes]], num_perm: int, seed: int) -> np.ndarray:
    minhashes = MinHash.bulk(batch, num_perm=num_perm, seed=seed, scheme=_SCHEME)
    return np.stack([m.hashvalues for m in minhashes])


class _UnionFind:
    """Clusters of document indices; a cluster's root is its smallest index."""

    def __init__(self) -> None:
        self.parent: list[int] = []

    def add(self) -> None:
        self.parent.append(len(self.parent))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)


def dedup_documents(cfg: DedupConfig, input_file: Path, out_dir: Path) -> dict:
    """Remove exact and near duplicates from `input_file` into `out_dir/documents.jsonl`."""
    ids: list[str] = []
    lengths: list[int] = []
    domains: list[str] = []
    exact_keys: list[str] = []
    groups = _UnionFind()
    first_with_key: dict[str, int] = {}
    hashed: list[int] = []  # documents with a MinHash signature, in signature order
    with _Signer(cfg) as signer:
        for i, doc in enumerate(read_documents(input_file)):
            normalized = normalize(doc.text, cfg)
            key = hashlib.sha256(normalized.encode("utf-8")).hexdigest()
            ids.append(doc.id)
            lengths.append(len(doc.text))
            domains.append(doc.domain)
            exact_keys.append(key)
            groups.add()
            if cfg.exact and key in first_with_key:
                # An exact copy is clustered already: it needs no signature of its own.
                groups.union(first_with_key[key], i)
                continue
            first_with_key.setdefault(key, i)
            if cfg.fuzzy:
                doc_shingles = shingles(normalized, cfg.shingle_size)
                if doc_shingles:
                    hashed.append(i)
                    signer.add(doc_shingles)
        signatures = signer.signatures()
    if cfg.fuzzy:
        for a, b in _similar_pairs(cfg, signatures):
            groups.union(hashed[a], hashed[b])

    n = len(ids)
    clusters: dict[int, list[int]] = defaultdict(list)
    for i in range(n):
        clusters[groups.find(i)].append(i)
    survivor_of: dict[int, int] = {}
    for members in clusters.values():
        best = min(members, key=lambda i: (-lengths[i], i))
        for i in members:
            survivor_of[i] = best

    counts = DocCounts(num_in=n)
    removed_by_domain: Counter[str] = Counter()
    with (
        open(out_dir / DOCUMENTS_FILE, "w", encoding="utf-8") as out,
        ReasonLog(out_dir / REMOVED_FILE) as removed,
    ):
        for i, doc in enumerate(read_documents(input_file)):
            survivor = survivor_of[i]
            if survivor == i:
                out.write(doc.to_json() + "\n")
                counts.num_kept += 1
                continue
            # The reason is the relation to the kept document, whichever member made the link.
            exact = cfg.exact and exact_keys[survivor] == exact_keys[i]
            reason = "exact_duplicate" if exact else "near_duplicate"
            doc.metadata["duplicate_of"] = ids[survivor]
            removed.add(reason, asdict(doc))
            counts.removed[reason] += 1
            removed_by_domain[doc.domain] += 1

    dup_clusters = sorted(
        (members for members in clusters.values() if len(members) > 1),
        key=lambda members: (-len(members), members[0]),
    )
    domain_totals = Counter(domains)
    return {
        **counts.as_dict(),
        "num_clusters": len(dup_clusters),
        "duplicate_rate_by_domain": {
            d: removed_by_domain[d] / total for d, total in sorted(domain_totals.items())
        },
        "cluster_sizes": {
            str(size): num for size, num in sorted(Counter(len(m) for m in dup_clusters).items())
        },
        "sample_clusters": [
            {"survivor": ids[survivor_of[m[0]]], "members": [ids[i] for i in m[:10]], "size": len(m)}
            for m in dup_clusters[:_NUM_SAMPLE_CLUSTERS]
        ],
    }


class _Signer:
    """Computes MinHash signatures batch by batch as documents stream past, on `num_workers`."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.pending: list[list[bytes]] = []
        self.parts: list[Future[np.ndarray] | np.ndarray] = []
        self.pool: ProcessPoolExecutor | None = None
        if cfg.num_workers > 1:
            # forkserver, not fork: the caller (a flow runner) may hold threads, and locks, that fork copies.
            context = multiprocessing.get_context("forkserver")
            self.pool = ProcessPoolExecutor(cfg.num_workers, mp_context=context)

    def add(self, doc_shingles: list[bytes]) -> None:
        self.pending.append(doc_shingles)
        if len(self.pending) == _BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        args = (self.pending, self.cfg.num_perm, self.cfg.seed)
        self.parts.append(self.pool.submit(_signatures, *args) if self.pool else _signatures(*args))
        self.pending = []

    def signatures(self) -> np.ndarray:
        """One row per added document, in the order added."""
        self._flush()
        rows = [part.result() if isinstance(part, Future) else part for part in self.parts]
        return np.concatenate(rows) if rows else np.zeros((0, self.cfg.num_perm), dtype=np.uint32)

    def __enter__(self) -> _Signer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _similar_pairs(cfg: DedupConfig, signatures: np.ndarray) -> list[tuple[int, int]]:
    """(earlier, later) index pairs that LSH proposes and whose estimated Jaccard reaches the threshold."""
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    pairs = []
    for a, row in enumerate(signatures):
        minhash = LeanMinHash(seed=cfg.seed, hashvalues=row, scheme=_SCHEME)
        for b in sorted(lsh.query(minhash)):
            # Estimated Jaccard: the fraction of permutations on which the signatures agree.
            if np.mean(signatures[a] == signatures[b]) >= cfg.threshold:
                pairs.append((b, a))
        lsh.insert(a, minhash)
    return pairs
