"""The dedup stage's algorithm: exact (normalised-text digest), then fuzzy (MinHash LSH) duplicates.

Fuzzy matching uses the vectorised signatures and banding of `tasks.data.minhash`: LSH proposes
candidate pairs, and a pair counts only if its estimated Jaccard similarity (the fraction of
agreeing permutations) reaches the verification threshold. Duplicates are clustered (connected
components), and each cluster keeps one document: the highest `metadata.quality_score` (documents
without one rank below any with one), then the longest text, then the smallest id — never input
position, so shuffling the input keeps the same survivors. The others are removed with
`metadata.duplicate_of` naming the survivor. Output keeps input order.

It runs in three steps (`tasks.data.dedup_job` runs them): `sign_shard` computes each input
shard's digests and signatures (a task per shard, in parallel); the clusters are found and every
document's fate decided — `cluster` here does it in one process holding every id, digest and
signature (the reference: tests hold the stage to it), the stage does it by partition
(`tasks.data.dedup_partition`), so that no process holds the corpus; `write_shard` writes each
shard's kept and removed documents (a task per shard again), tallying `removals.json` as it writes. Signing records what writing needs of each
line (domain, text bytes, whether it is already its document's `Document.to_json_line()`, true of
every file a Kiln stage writes), so the write pass parses no canonical line: it writes it back byte
for byte when kept and splices it into its removal record when removed; any other line is parsed
again and re-serialised, so the output is the same either way. Clustering is array work (digests
sorted for exact copies, one lexsort for every cluster's survivor), not a loop over documents.

Every run saves its kept documents' signatures and LSH bucket tables in `out_dir/lsh_index/`, so
a later batch can be deduplicated against everything kept so far without recomputing a signature.
"""

from __future__ import annotations

import hashlib
import math
import sys
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from json.encoder import encode_basestring, encode_basestring_ascii
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from kiln.tasks.accounting import DocCounts
from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.data import minhash
from kiln.tasks.data.dedup_index import DIGEST_BYTES, SNIPPET_CHARS, DedupIndex, digest_array
from kiln.tasks.data.dedup_partition import sample_clusters
from kiln.tasks.data.documents import Document, read_lines
from kiln.tasks.data.inspection import RemovalTally, text_bytes
from kiln.tasks.data.shards import RankShards

_BATCH = 1000  # documents per signature batch: amortises numpy calls, bounds memory per worker
_BATCH_CHARS = 8_000_000  # ...or fewer, once a batch holds this much text (enormous documents)
PLOT_FILE = "cluster_sizes.png"


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
    # The Jaccard similarity the LSH bands are chosen for (minimising fp_weight x false positives
    # below it + fn_weight x false negatives above it, as datasketch does). At 0.7 with 128
    # permutations that is 14 bands of 9 rows: >= 97.5% of pairs at 0.85 become candidates and
    # about 3% at 0.5 (tests/tasks/data/test_dedup_evidence.py measures the end result).
    threshold: float = Field(0.7, gt=0.0, le=1.0)
    # Estimated Jaccard a candidate pair must reach to count; None means `threshold`.
    verify_threshold: float | None = Field(None, gt=0.0, le=1.0)
    fp_weight: float = Field(0.5, ge=0.0)
    fn_weight: float = Field(0.5, ge=0.0)
    seed: int = 1
    # fast: Kiln's numpy path, signatures and writing a task per shard on `cluster.executor`, clusters in
    # one process; datatrove: datatrove's 4-stage MinHash pipeline on `cluster.executor` (local processes,
    # Slurm or Ray). Their normalisation differs (see tasks/data/dedup_datatrove.py), so the engine is
    # part of the key.
    engine: Literal["fast", "datatrove"] = "fast"
    num_workers: int = runtime_field(1, ge=1)  # shards signed and written at once (datatrove engine: its tasks)


def lsh_bands(cfg: DedupConfig) -> tuple[int, int]:
    """(bands, rows) this config's LSH uses."""
    return minhash.lsh_params(cfg.threshold, cfg.num_perm, cfg.fp_weight, cfg.fn_weight)


def verify_threshold(cfg: DedupConfig) -> float:
    return cfg.threshold if cfg.verify_threshold is None else cfg.verify_threshold


# Unicode punctuation (categories P*) and whitespace (str.isspace): ASCII is classified by byte tables
# (`bytes.translate` tables for a batch), other code points by `_CodePointClasses`.
_ASCII_PUNCTUATION = bytes(c for c in range(128) if unicodedata.category(chr(c)).startswith("P"))
_ASCII_SPACE = np.array([chr(c).isspace() for c in range(256)]) & (np.arange(256) < 128)


def _ascii_table(lower: bool, whitespace: bool) -> bytes:
    """A `bytes.translate` table: ASCII letters lowercased (if `lower`), ASCII whitespace to b" " (if `whitespace`)."""
    table = bytearray(range(256))
    for c in range(128):
        if lower and chr(c).isupper():
            table[c] = ord(chr(c).lower())
        if whitespace and chr(c).isspace():
            table[c] = 0x20
    return bytes(table)


_ASCII_TABLES = {(lower, space): _ascii_table(lower, space) for lower in (False, True) for space in (False, True)}
_SEP = b"\xff"  # never in UTF-8: separates a batch's texts
_GONE = np.uint8(0xFE)  # never in UTF-8 either: marks the bytes of a deleted character
# Bits of _CodePointClasses: classified; punctuation; whitespace; casefold changes it; ...into one code
# point of the same UTF-8 length (written over it in place; any other fold needs str.casefold).
_KNOWN, _PUNCTUATION, _SPACE, _FOLDS, _FOLDS_IN_PLACE = (np.uint8(1 << k) for k in range(5))


class _CodePointClasses:
    """Which code points are punctuation, whitespace, changed by casefold (and into what), as tables
    filled in for the code points texts actually use: one gather per character beats any
    per-character call, and classifying all 1.1M code points up front cost more than normalising a corpus."""

    def __init__(self) -> None:
        self.bits = np.zeros(sys.maxunicode + 1, dtype=np.uint8)
        self.folded = np.zeros(sys.maxunicode + 1, dtype=np.uint32)  # where _FOLDS_IN_PLACE: the fold

    def classify(self, codes: np.ndarray) -> np.ndarray:
        """The class bits of each code point."""
        bits = self.bits[codes]
        if bits.all():  # the usual case: every code point seen before
            return bits
        for code in np.unique(codes[bits == 0]).tolist():
            char = chr(code)
            folded = char.casefold()
            in_place = (folded != char and len(folded) == 1
                        and len(folded.encode("utf-8", "surrogatepass")) == len(char.encode("utf-8", "surrogatepass")))
            self.folded[code] = ord(folded) if in_place else code
            self.bits[code] = (_KNOWN | (_PUNCTUATION if unicodedata.category(char).startswith("P") else 0)
                               | (_SPACE if char.isspace() else 0) | (_FOLDS if folded != char else 0)
                               | (_FOLDS_IN_PLACE if in_place else 0))
        return self.bits[codes]


_CLASSES = _CodePointClasses()


def _normalize_batch(texts: Sequence[str], case: bool, punctuation: bool, whitespace: bool) -> list[bytes]:
    """Each text casefolded (if `case`), without punctuation (if `punctuation`), and with every whitespace
    run one space and none at either end (if `whitespace`, as `" ".join(text.split())`), as UTF-8
    (lone surrogates as "surrogatepass" writes them).

    The whole batch is one byte string, texts separated by a byte UTF-8 never holds, worked on with a
    few vectorised passes instead of numpy calls per text: ASCII by one `bytes.translate` (lowercase,
    whitespace to b" ", punctuation deleted), other characters by their code points, decoded from their
    lead bytes (few: most text is ASCII even in most other languages' documents)."""
    if not texts:
        return []
    raw = _SEP.join([t.encode("utf-8", "surrogatepass") for t in texts]).translate(
        _ASCII_TABLES[case, whitespace], _ASCII_PUNCTUATION if punctuation else b"")
    data = np.frombuffer(raw, dtype=np.uint8)
    lead = np.flatnonzero(data >= 0xC0)  # the first byte of each character beyond ASCII (and separators)
    lead = lead[data[lead] != _SEP[0]]
    refold: list[int] = []
    if lead.size:
        first = data[lead].astype(np.uint32)
        size = np.where(first < 0xE0, 2, np.where(first < 0xF0, 3, 4))
        more = [data[np.minimum(lead + k, data.size - 1)].astype(np.uint32) & 0x3F for k in (1, 2, 3)]
        codes = np.where(size == 2, ((first & 0x1F) << 6) | more[0],
                         np.where(size == 3, ((first & 0x0F) << 12) | (more[0] << 6) | more[1],
                                  ((first & 0x07) << 18) | (more[0] << 12) | (more[1] << 6) | more[2]))
        bits = _CLASSES.classify(codes)
        edit = ((bits & _PUNCTUATION) != 0) if punctuation else np.zeros(bits.size, dtype=bool)
        if whitespace:
            edit |= (bits & _SPACE) != 0
        folds = ((bits & _FOLDS) != 0) if case else np.zeros(bits.size, dtype=bool)
        if (folds & ((bits & _FOLDS_IN_PLACE) == 0)).any():  # rare (ß, İ, ligatures): those texts by str.casefold
            separators = np.flatnonzero(data == _SEP[0])
            refold = np.unique(np.searchsorted(separators, lead[folds & ((bits & _FOLDS_IN_PLACE) == 0)])).tolist()
        folds &= (bits & _FOLDS_IN_PLACE) != 0
        if edit.any() or folds.any():
            data = data.copy()
            # Punctuation: every byte marked gone; whitespace: every byte a space (the run collapses below);
            # a fold: the folded code point's bytes, as many as the original's. (Characters that fold are
            # letters, never punctuation or whitespace, and neither are their folds.)
            at, code = lead[edit | folds], np.where(folds, _CLASSES.folded[codes], 0)[edit | folds]
            at_size, is_fold = size[edit | folds], folds[edit | folds]
            is_gone = ((bits & _PUNCTUATION) != 0)[edit | folds] & ~is_fold
            for k in range(4):
                part = at_size > k
                shift = 6 * (at_size[part] - 1 - k)
                folded = ((code[part] >> shift) & 0x3F) | np.where(k == 0, (0xF00 >> at_size[part]) & 0xFF, 0x80)
                data[at[part] + k] = np.where(is_fold[part], folded, np.where(is_gone[part], _GONE, 0x20))
            if punctuation:
                data = data[data != _GONE]
    if whitespace:
        space = data == 0x20
        repeat = space[1:] & space[:-1]
        if repeat.any():
            keep = np.empty(data.size, dtype=bool)
            keep[0] = True
            np.logical_not(repeat, out=keep[1:])
            data = data[keep]
        parts = [part.strip(b" ") for part in data.tobytes().split(_SEP)]
    else:
        parts = data.tobytes().split(_SEP)
    if refold:
        for i, redone in zip(refold, _normalize_batch([texts[i].casefold() for i in refold], case, punctuation,
                                                      whitespace)):
            parts[i] = redone
    return parts


def _strip(text: str, punctuation: bool, whitespace: bool) -> str:
    """`text` without punctuation (if `punctuation`) and with every whitespace run one space and
    none at either end (if `whitespace`, as `" ".join(text.split())`), in one vectorised pass. One text at
    a time (`normalize`, decontamination): `_normalize_batch` does the same to a batch, with fewer numpy
    calls per text but more per call."""
    if text.isascii():
        codes = np.frombuffer(text.encode("ascii").translate(None, _ASCII_PUNCTUATION if punctuation else b""),
                              dtype=np.uint8)
        if not whitespace:
            return codes.tobytes().decode("ascii")
        is_space = _ASCII_SPACE[codes]
    else:
        # One code point per uint32; surrogatepass keeps lone surrogates (valid in JSON) intact.
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        bits = _CLASSES.classify(codes)
        if punctuation:
            kept = (bits & _PUNCTUATION) == 0
            codes, bits = codes[kept], bits[kept]
        is_space = (bits & _SPACE) != 0
    if whitespace and codes.size:
        keep = ~is_space  # ...and the first space of each run inside the text
        keep[1:] |= is_space[1:] & ~is_space[:-1]
        codes, is_space = codes[keep], is_space[keep]
        if is_space.size and is_space[-1]:
            codes, is_space = codes[:-1], is_space[:-1]
        codes = np.where(is_space, codes.dtype.type(0x20), codes)
    return codes.tobytes().decode("ascii" if codes.dtype == np.uint8 else "utf-32-le", "surrogatepass")


def strip_punctuation(text: str) -> str:
    return _strip(text, punctuation=True, whitespace=False)


def _normalized_utf8(texts: Sequence[str], cfg: DedupConfig) -> list[bytes]:
    """`normalize` of each text, as UTF-8 (lone surrogates as "surrogatepass" writes them)."""
    texts = [unicodedata.normalize("NFKC", text) for text in texts]
    if not (cfg.normalize_case or cfg.normalize_punctuation or cfg.normalize_whitespace):
        return [text.encode("utf-8", "surrogatepass") for text in texts]
    return _normalize_batch(texts, cfg.normalize_case, cfg.normalize_punctuation, cfg.normalize_whitespace)


def normalize(text: str, cfg: DedupConfig) -> str:
    """Unicode NFKC, then casefold, punctuation deleted and whitespace collapsed as `cfg` says. The stage
    normalises its signature batches with `_normalized_utf8`, which gives the same, as UTF-8."""
    text = unicodedata.normalize("NFKC", text)
    if cfg.normalize_case:  # casefold is lower on ASCII, and lower has CPython's ASCII fast path
        text = text.lower() if text.isascii() else text.casefold()
    if cfg.normalize_punctuation or cfg.normalize_whitespace:
        text = _strip(text, cfg.normalize_punctuation, cfg.normalize_whitespace)
    return text


def shingles(normalized: str, size: int) -> list[bytes]:
    """Distinct shingles of a normalised text, as UTF-8: word n-grams of its space-joined words,
    or character n-grams when words are fewer than `size` or unsegmented (mean length > 12); a
    text shorter than one shingle is one shingle. `minhash.signatures` hashes exactly these."""
    text = minhash.shingle_text(normalized)
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    starts, ends = minhash.shingle_spans(data, minhash.uses_word_shingles(text, size), size)
    raw = data.tobytes()
    return sorted({raw[s:e] for s, e in zip(starts.tolist(), ends.tolist())})


def signature_settings(cfg: DedupConfig) -> dict[str, Any]:
    """Everything an index's signatures, digests and band keys depend on."""
    bands, rows = lsh_bands(cfg)
    return {
        "normalize_case": cfg.normalize_case, "normalize_whitespace": cfg.normalize_whitespace,
        "normalize_punctuation": cfg.normalize_punctuation, "shingle_size": cfg.shingle_size,
        "num_perm": cfg.num_perm, "seed": cfg.seed, "bands": bands, "rows": rows,
        "scheme": "affine32", "shingle_hash": "poly64-fmix64-hi32",
    }


@dataclass
class SignedShard:
    """What `cluster` needs of one shard's documents, in input order: no text but a snippet."""

    ids: np.ndarray  # str
    lengths: np.ndarray  # int64: characters
    quality: np.ndarray  # float64: metadata.quality_score, NaN where absent
    snippets: np.ndarray  # str: the first SNIPPET_CHARS characters
    digests: np.ndarray  # (n, DIGEST_BYTES) uint8: digest of the normalised text
    signatures: np.ndarray  # (n, num_perm) uint32
    has_shingles: np.ndarray  # bool
    # What the write pass needs of each line, recorded while signing so that it copies lines unparsed:
    domains: np.ndarray  # str
    text_bytes: np.ndarray  # int64: `inspection.text_bytes` of the text
    canonical: np.ndarray  # bool: the line is its document's `to_json_line()`, without metadata.duplicate_of
    has_metadata: np.ndarray  # bool: a non-empty metadata object (how a removal record is spliced)

    def save(self, path: Path, names: tuple[str, ...] | None = None) -> None:
        """Save the arrays (only `names`, when given: `load` leaves the others empty)."""
        np.savez(path, **{name: array for name, array in vars(self).items() if names is None or name in names})

    @classmethod
    def load(cls, path: Path, names: tuple[str, ...] | None = None) -> SignedShard:
        """The shard's arrays (only `names`, the others empty, when given: the write pass needs four)."""
        with np.load(path, allow_pickle=False) as arrays:
            return cls(**{name: arrays[name] if name in arrays.files and (names is None or name in names)
                          else np.zeros(0) for name in cls.__dataclass_fields__})


def sign_shard(cfg: DedupConfig, shard: Path) -> SignedShard:
    """Digests and signatures of one shard's documents, `_BATCH` documents at a time. A normalised text
    seen before in the shard is not signed again: it takes the signature of its first occurrence."""
    ids: list[str] = []
    lengths: list[int] = []
    quality: list[float] = []
    snippets: list[str] = []
    domains: list[str] = []
    num_bytes: list[int] = []
    canonical: list[bool] = []
    has_metadata: list[bool] = []
    parts: list[tuple[list[bytes], np.ndarray, np.ndarray]] = []
    signed: set[bytes] = set()  # normalised texts signed so far
    pending: list[str] = []
    pending_chars = 0

    def sign() -> None:
        parts.append(_sign_batch(pending, cfg, signed))
        signed.update(parts[-1][0])

    for line in read_lines(shard):
        doc = Document.from_line(line)
        ids.append(doc.id)
        lengths.append(len(doc.text))
        quality.append(quality_score(doc))
        snippets.append(doc.text[:SNIPPET_CHARS])
        domains.append(doc.domain)
        num_bytes.append(text_bytes(doc.text))
        canonical.append(line == doc.to_json_line() and "duplicate_of" not in doc.metadata)
        has_metadata.append(bool(doc.metadata))
        pending.append(doc.text)
        pending_chars += len(doc.text)
        if len(pending) >= _BATCH or pending_chars >= _BATCH_CHARS:
            sign()
            pending, pending_chars = [], 0
    if pending:
        sign()
    digests = [digest for part in parts for digest in part[0]]
    signatures = (np.concatenate([part[1] for part in parts]) if parts
                  else np.zeros((0, cfg.num_perm), dtype=np.uint32))
    first_row: dict[bytes, int] = {}
    copies = [(row, first) for row, digest in enumerate(digests) if (first := first_row.setdefault(digest, row)) != row]
    if copies and cfg.fuzzy:
        rows, firsts = np.array(copies).T
        signatures[rows] = signatures[firsts]
    return SignedShard(
        ids=np.array(ids, dtype=str), lengths=np.array(lengths, dtype=np.int64),
        quality=np.array(quality, dtype=np.float64), snippets=np.array(snippets, dtype=str),
        digests=digest_array(digests), signatures=signatures,
        has_shingles=np.concatenate([part[2] for part in parts]) if parts else np.zeros(0, dtype=bool),
        domains=np.array(domains, dtype=str), text_bytes=np.array(num_bytes, dtype=np.int64),
        canonical=np.array(canonical, dtype=bool), has_metadata=np.array(has_metadata, dtype=bool),
    )


@dataclass
class Clustering:
    """`cluster`'s decisions and what the stage reports of them."""

    removed: list[dict[int, tuple[str, str]]]  # per shard: position -> (reason, survivor id)
    index: DedupIndex  # the index extended with the kept documents
    sizes: Counter[int]  # clusters by number of members
    stats: dict[str, Any]


def cluster(cfg: DedupConfig, index: DedupIndex, shards: list[SignedShard]) -> Clustering:
    """Exact and fuzzy duplicates among `shards` (in input order) and against `index`, whose documents
    are published and so always survive; which document each removed one duplicates, and why. In one
    process: the reference `dedup_partition` (which the stage runs) must decide the same as.

    Vectorised: exact copies by sorting digests, components by scipy, survivors by one lexsort; Python
    touches only the removed documents (their decisions) and the sample clusters."""
    n = sum(len(shard.ids) for shard in shards)
    m = len(index)
    nodes = np.arange(m + n)  # graph nodes: indexed documents 0..m-1, then the new documents m..m+n-1
    ids = np.concatenate([index.ids, *(shard.ids for shard in shards)])
    digests = np.ascontiguousarray(np.concatenate([index.digests, *(shard.digests for shard in shards)]))
    signatures = np.concatenate([shard.signatures for shard in shards]) if shards else index.signatures[:0]
    has_shingles = np.concatenate([shard.has_shingles for shard in shards]) if shards else np.zeros(0, dtype=bool)
    edges = [np.zeros((0, 2), dtype=np.int64)]
    in_lsh = has_shingles.copy()
    if cfg.exact:
        # Each copy links to its digest's anchor: the last indexed document with it, else its first new one.
        halves = digests.view(np.uint64).reshape(-1, DIGEST_BYTES // 8)
        order = np.lexsort((np.where(nodes < m, -1 - nodes, nodes), *halves.T[::-1]))
        starts = np.ones(m + n, dtype=bool)
        starts[1:] = (halves[order[1:]] != halves[order[:-1]]).any(axis=1)
        anchors = order[starts][np.cumsum(starts) - 1]
        copies = (order != anchors) & (order >= m)
        edges.append(np.stack((anchors[copies], order[copies]), axis=1))
        in_lsh[order[copies] - m] = False  # an exact copy is clustered already: no fuzzy matching needed
    num_candidates = num_verified = 0
    if cfg.fuzzy:
        verify = verify_threshold(cfg)
        members = np.flatnonzero(in_lsh)
        sigs = signatures[members]
        keys = minhash.band_keys(sigs, index.settings["bands"], index.settings["rows"])
        inner = minhash.candidate_pairs(keys)
        cross = index.candidates(keys)
        num_candidates = len(inner) + len(cross)
        inner = inner[minhash.estimated_jaccard(sigs[inner[:, 0]], sigs[inner[:, 1]]) >= verify]
        cross = cross[minhash.estimated_jaccard(sigs[cross[:, 0]], index.signatures[cross[:, 1]]) >= verify]
        num_verified = len(inner) + len(cross)
        edges.append(m + members[inner])
        edges.append(np.stack((m + members[cross[:, 0]], cross[:, 1]), axis=1))
    labels, clustered = _components(m + n, np.concatenate(edges))

    # Survivor of each cluster: an indexed document if any (it is published), else the best new one by
    # `survivor_rank` (ties: the first node), found by one lexsort of the clustered nodes.
    quality = np.concatenate([index.quality, *(shard.quality for shard in shards)])
    lengths = np.concatenate([index.lengths, *(shard.lengths for shard in shards)])
    survivor_of = nodes.copy()
    if clustered.size:
        q = quality[clustered]
        id_rank = np.unique(ids[clustered], return_inverse=True)[1]
        ranked = clustered[np.lexsort((id_rank, -lengths[clustered], -np.nan_to_num(q, nan=0.0), np.isnan(q),
                                       clustered >= m, labels[clustered]))]
        first = np.ones(ranked.size, dtype=bool)
        first[1:] = labels[ranked[1:]] != labels[ranked[:-1]]
        best_of_label = np.zeros(m + n, dtype=np.int64)
        best_of_label[labels[ranked[first]]] = ranked[first]
        survivor_of[clustered] = best_of_label[labels[clustered]]

    new_survivors = survivor_of[m:]
    gone = np.flatnonzero(new_survivors != nodes[m:])  # new documents removed, by position among all new ones
    exact = np.zeros(gone.size, dtype=bool)
    if cfg.exact:  # the reason is the relation to the kept document, whichever member made the link
        exact = (digests[new_survivors[gone]] == digests[m + gone]).all(axis=1)
    reasons = np.where(exact, "exact_duplicate", "near_duplicate").tolist()
    survivor_ids = ids[new_survivors[gone]].tolist()
    bounds = np.cumsum([0] + [len(shard.ids) for shard in shards])
    shard_of = np.searchsorted(bounds, gone, side="right") - 1
    removed: list[dict[int, tuple[str, str]]] = [{} for _ in shards]
    for k, (node, shard) in enumerate(zip(gone.tolist(), shard_of.tolist())):
        removed[shard][node - int(bounds[shard])] = (reasons[k], survivor_ids[k])

    snippets = np.concatenate([index.snippets, *(shard.snippets for shard in shards)])
    kept = np.flatnonzero(survivor_of == nodes)
    kept = kept[kept >= m]
    extended = index.extended(
        ids=ids[kept], digests=digests[kept], lengths=lengths[kept], quality=quality[kept], snippets=snippets[kept],
        signatures=signatures[kept - m], in_lsh=has_shingles[kept - m],
    )
    sizes_by_label = np.bincount(labels, minlength=1)
    sizes = Counter({int(size): int(num) for size, num in zip(*np.unique(sizes_by_label[sizes_by_label > 1],
                                                                         return_counts=True))})
    bands, rows = index.settings["bands"], index.settings["rows"]
    stats = {
        "num_clusters": int((sizes_by_label > 1).sum()),
        "num_indexed_before": m,
        "num_candidate_pairs": num_candidates,
        "num_verified_pairs": num_verified,
        "lsh": {"bands": bands, "rows": rows, "verify_threshold": verify_threshold(cfg)},
        "cluster_sizes": {str(size): num for size, num in sorted(sizes.items())},
        "sample_clusters": [
            {"survivor": str(ids[clustered[c[0]]]), "size": size,
             "members": [{"id": str(ids[i]), "snippet": str(snippets[i])} for i in clustered[c]]}
            # `clustered` ascends and holds every survivor: a survivor's node as its position there
            for size, c in sample_clusters(labels[clustered], clustered,
                                           np.searchsorted(clustered, survivor_of[clustered]))
        ],
    }
    return Clustering(removed, extended, sizes, stats)


def write_shard(shard: Path, shards: RankShards, removed: Callable[[int, str], tuple[str, str] | None],
                signed: SignedShard | None = None) -> dict[str, Any]:
    """Write one input shard's kept and removed documents; `removed(position, id)` gives a removed
    document's (reason, survivor id), None for a kept one. Returns its counts and tally.

    With `signed` (the shard's `sign_shard`: ids, domains, text bytes, canonical, has_metadata), a
    canonical line is copied or spliced without being parsed; any other line is parsed here."""
    counts = DocCounts()
    removed_by_domain: Counter[str] = Counter()
    tally = RemovalTally()
    facts = None if signed is None else zip(signed.ids.tolist(), signed.domains.tolist(), signed.text_bytes.tolist(),
                                           signed.canonical.tolist(), signed.has_metadata.tolist(), strict=True)
    for position, line in enumerate(read_lines(shard)):
        doc: Document | None = None
        if facts is not None:
            doc_id, domain, num_bytes, canonical, has_metadata = next(facts)
        if facts is None or not canonical:
            doc = Document.from_line(line)
            doc_id, domain, num_bytes = doc.id, doc.domain, text_bytes(doc.text)
            # the line is the document's canonical form: kept as it is, or spliced into its removal record
            canonical = line == doc.to_json_line() and "duplicate_of" not in doc.metadata
            has_metadata = bool(doc.metadata)
        counts.num_in += 1
        decision = removed(position, doc_id)
        if decision is None:
            shards.kept.write_line(line if canonical else doc.to_json_line())  # type: ignore[union-attr]
            counts.num_kept += 1
            tally.add("kept", domain, num_bytes)
            continue
        reason, survivor_id = decision
        if canonical:
            shards.removed.write_line(_spliced_removal(line, b", " if has_metadata else b"", reason, survivor_id))
        else:
            assert doc is not None
            doc.metadata["duplicate_of"] = survivor_id
            shards.removed.add(reason, vars(doc))
        counts.removed[reason] += 1
        removed_by_domain[domain] += 1
        tally.add("removed", domain, num_bytes, reason)
    return {"counts": counts.as_dict(), "removed_by_domain": dict(removed_by_domain), "tally": tally.table()}


def _components(num_nodes: int, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each node's connected component label, and the nodes in components of more than one, ascending."""
    # Imported here, as matplotlib below: worker processes import this module only to sign.
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(num_nodes, num_nodes))
    _, labels = connected_components(graph, directed=False)
    return labels, np.flatnonzero(np.bincount(labels)[labels] > 1)  # singletons, nearly all nodes, skipped


def plot_cluster_sizes(sizes: Counter[int], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(5, 3.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    xs = sorted(sizes)
    axes.bar([str(x) for x in xs], [sizes[x] for x in xs], color="#4477aa")
    axes.set_xlabel("documents in cluster")
    axes.set_ylabel("clusters")
    axes.yaxis.set_major_locator(MaxNLocator(5, integer=True))  # whole clusters: no fractional ticks
    axes.set_title(f"Duplicate clusters ({sum(sizes.values())})")
    figure.subplots_adjust(left=0.16, bottom=0.16, right=0.97, top=0.9)  # fixed: tight_layout doubled the cost
    figure.savefig(path, dpi=80)


def _spliced_removal(line: bytes, splice: bytes, reason: str, survivor_id: str) -> bytes:
    """The removed document's record as `ShardWriter.add(reason, vars(doc))` writes it, with
    `metadata.duplicate_of`, spliced into its canonical line instead of parsed and re-serialised."""
    # `line` is `{...fields, "metadata": {...}}` + newline (`to_json_line` writes the fields in the
    # dataclass's order, metadata last): open both braces, append, close them.
    # (json.dumps of a str is encode_basestring_ascii's, or encode_basestring's without ensure_ascii; called
    # directly, not through a JSONEncoder made each call)
    return (b'{"reason": ' + encode_basestring_ascii(reason).encode() + b", " + line[1:-3] + splice
            + b'"duplicate_of": ' + encode_basestring(survivor_id).encode("utf-8") + b"}}\n")


def _sign_batch(texts: list[str], cfg: DedupConfig, signed_before: AbstractSet[bytes] = frozenset()
                ) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """Digests of the normalised texts, their signatures, and which have any shingle.

    Equal normalised texts have equal signatures, so only the first of each that is not in
    `signed_before` is signed (exact copies are a large share of real corpora); the other rows
    stay empty for `sign_shard` to fill.
    """
    normalized = _normalized_utf8(texts, cfg)
    digests = [hashlib.blake2b(t, digest_size=DIGEST_BYTES).digest() for t in normalized]
    if not cfg.fuzzy:
        return digests, np.zeros((len(texts), cfg.num_perm), dtype=np.uint32), np.zeros(len(texts), dtype=bool)
    # Whitespace-normalised text is its own shingle text (single spaces, no space at either end).
    has_shingles = np.array([bool(t) and (cfg.normalize_whitespace or not t.decode("utf-8", "surrogatepass").isspace())
                             for t in normalized], dtype=bool)
    first_rows = {digest: row for row, digest in reversed(list(enumerate(digests))) if digest not in signed_before}
    rows = sorted(first_rows.values())
    sigs = np.full((len(texts), cfg.num_perm), minhash.EMPTY_HASH, dtype=np.uint32)
    if cfg.normalize_whitespace:
        sigs[rows] = minhash.signatures_utf8([normalized[row] for row in rows], cfg.shingle_size, cfg.num_perm, cfg.seed)
    else:
        sigs[rows] = minhash.signatures([normalized[row].decode("utf-8", "surrogatepass") for row in rows],
                                        cfg.shingle_size, cfg.num_perm, cfg.seed)
    return digests, sigs, has_shingles


def quality_score(doc: Document) -> float:
    """The document's `metadata.quality_score`, NaN when it has none."""
    score = doc.metadata.get("quality_score")
    return float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else math.nan


def survivor_rank(quality: float, length: int, doc_id: str) -> tuple[bool, float, int, str]:
    """Sort key of the copy a cluster keeps (smallest wins): highest quality score (none ranks
    last), then the longest text, then the smallest id. Shared by every dedup engine."""
    return (math.isnan(quality), -(0.0 if math.isnan(quality) else quality), -length, doc_id)
