"""Vectorised MinHash signatures and LSH banding, bit-compatible with datasketch 2.0.

Shingles are byte spans of a document's space-joined text (word n-grams, or character n-grams
for unsegmented scripts and texts of few words). Each span is hashed to 32 bits by
`shingle_hash32` — a polynomial hash of its UTF-8 bytes, computed for a whole batch at once from
prefix sums instead of one Python call per shingle — and then permuted exactly as datasketch's
`affine32` scheme does (MurmurHash3 fmix32 pre-mix, then `a*h + b mod 2^32` with datasketch's
seeded `a`, `b`). So a row of `signatures()` equals
`datasketch.MinHash(num_perm, seed, hashfunc=shingle_hash32)` updated with the same shingles,
and signatures can go straight into a `MinHashLSH` as `LeanMinHash`es.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

# Mean "word" length (spaces included) above which text is treated as unsegmented (Chinese,
# Japanese, Thai): spaced languages average 4-8 characters a word.
UNSEGMENTED_WORD_LEN = 12
EMPTY_HASH = np.uint32(0xFFFFFFFF)  # datasketch's value for a permutation that saw no shingle

_MASK64 = (1 << 64) - 1
_BASE = 0x100000001B3  # FNV-1a's 64-bit prime: odd, so invertible mod 2^64
_BASE_INV = pow(_BASE, -1, 1 << 64)
_SPAN_BLOCK = 1 << 16  # spans hashed per block: bounds the prefix arrays for enormous documents
_POWER_CACHE_MAX = 1 << 20  # powers of the base kept between calls (16 MB); longer blocks compute their own
_PERM_BLOCK = 1 << 13  # shingles per permutation block: 4 MB of uint32 at 128 permutations
# Members of one LSH bucket compared with each other: a bucket is all pairs up to this size,
# and each member with its next (this - 1) members beyond, so huge buckets stay linear.
BUCKET_WINDOW = 64

_FMIX32 = (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35), np.uint32(16))
_FMIX64 = (np.uint64(33), np.uint64(0xFF51AFD7ED558CCD), np.uint64(33), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33))


def _fmix(values: np.ndarray, constants: tuple) -> np.ndarray:
    """MurmurHash3's finalizer (array arithmetic wraps, which is the intended modulo)."""
    s1, m1, s2, m2, s3 = constants
    values = values ^ (values >> s1)
    values = values * m1
    values = values ^ (values >> s2)
    values = values * m2
    return values ^ (values >> s3)


def shingle_hash32(shingle: bytes) -> int:
    """The 32-bit hash of one shingle; pass it as datasketch's `hashfunc` to reproduce `signatures()`.

    Polynomial hash of the bytes (each plus one, so leading NULs count) mod 2^64, then fmix64 and
    the top 32 bits: the polynomial form is what lets `signatures()` hash every span of a batch
    from one prefix sum.
    """
    h = 0
    for byte in shingle:
        h = (h * _BASE + byte + 1) & _MASK64
    return int(_fmix(np.array([h], dtype=np.uint64), _FMIX64)[0] >> np.uint64(32))


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch 2.0's affine32 parameters: odd multipliers `a`, offsets `b` (uint32)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def shingle_text(normalized: str) -> str:
    """The text shingles are cut from: words joined by single spaces."""
    return " ".join(normalized.split())


def uses_word_shingles(text: str, size: int) -> bool:
    """Word n-grams for spaced text with at least `size` words; else character n-grams."""
    num_words = text.count(" ") + 1 if text else 0
    return num_words >= size and len(text) / num_words <= UNSEGMENTED_WORD_LEN


def shingle_spans(data: np.ndarray, word_mode: bool, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) byte offsets of the shingles of one document's `shingle_text` as UTF-8.

    Character n-grams of a text shorter than `size` are the whole text (one shingle); spans may
    repeat (a MinHash is a set, so repeats are harmless).
    """
    if data.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if word_mode:
        spaces = np.flatnonzero(data == 0x20)
        starts = np.concatenate(([0], spaces + 1))
        ends = np.concatenate((spaces, [data.size]))
    else:
        # A character starts at every byte that is not a UTF-8 continuation byte (10xxxxxx).
        starts = np.flatnonzero((data & 0xC0) != 0x80)
        ends = np.concatenate((starts[1:], [data.size]))
    if starts.size < size:
        return np.array([0]), np.array([data.size])
    return starts[: starts.size - size + 1].astype(np.int64), ends[size - 1 :].astype(np.int64)


def _compute_powers(length: int) -> tuple[np.ndarray, np.ndarray]:
    """(B^k for k in 0..length, B^-(k+1) for k in 0..length-1), uint64 (mod 2^64)."""
    inv_powers = np.cumprod(np.full(length, _BASE_INV, dtype=np.uint64))
    powers = np.empty(length + 1, dtype=np.uint64)
    powers[0] = 1
    np.cumprod(np.full(length, _BASE, dtype=np.uint64), out=powers[1:])
    return powers, inv_powers


_powers_cache = _compute_powers(0)


def _powers(length: int) -> tuple[np.ndarray, np.ndarray]:
    """`_compute_powers(length)`, sliced from tables kept between calls: every block of every
    batch needs the same powers, and recomputing them was a sixth of the signature time."""
    global _powers_cache
    if length > _POWER_CACHE_MAX:
        return _compute_powers(length)
    if length >= len(_powers_cache[0]):
        _powers_cache = _compute_powers(min(max(length, 2 * len(_powers_cache[0])), _POWER_CACHE_MAX))
    powers, inv_powers = _powers_cache
    return powers[: length + 1], inv_powers[:length]


def span_hashes(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """`shingle_hash32` of every span `data[s:e]`, vectorised. `starts` must be ascending."""
    out = np.empty(starts.size, dtype=np.uint32)
    for lo in range(0, starts.size, _SPAN_BLOCK):
        s, e = starts[lo : lo + _SPAN_BLOCK], ends[lo : lo + _SPAN_BLOCK]
        base, top = int(s[0]), int(e.max())
        # prefix[k] = sum_{i<k} (byte_i + 1) * B^-(i+1), so (prefix[e] - prefix[s]) * B^e is the
        # polynomial hash of bytes s..e-1: relative offsets, so each block starts afresh.
        length = top - base
        powers, inv_powers = _powers(length)
        terms = (data[base:top].astype(np.uint64) + np.uint64(1)) * inv_powers
        prefix = np.zeros(length + 1, dtype=np.uint64)
        np.cumsum(terms, dtype=np.uint64, out=prefix[1:])
        local_s, local_e = s - base, e - base
        poly = (prefix[local_e] - prefix[local_s]) * powers[local_e]
        out[lo : lo + _SPAN_BLOCK] = (_fmix(poly, _FMIX64) >> np.uint64(32)).astype(np.uint32)
    return out


def signatures(texts: Sequence[str], shingle_size: int, num_perm: int, seed: int, joined: bool = False) -> np.ndarray:
    """MinHash signatures (len(texts) x num_perm, uint32) of normalised texts, all at once.

    `joined`: the texts are already their own `shingle_text` (whitespace-normalised). A text
    without shingles (empty) keeps the empty signature (all 0xFFFFFFFF), as in datasketch.
    """
    return signatures_utf8([t.encode("utf-8", "surrogatepass") for t in (texts if joined else map(shingle_text, texts))],
                           shingle_size, num_perm, seed)


def signatures_utf8(joined: Sequence[bytes], shingle_size: int, num_perm: int, seed: int) -> np.ndarray:
    """`signatures` of texts given as the UTF-8 of their `shingle_text` (lone surrogates as "surrogatepass"
    writes them): the dedup stage normalises to bytes, so nothing is decoded and encoded again."""
    a, b = permutations(num_perm, seed)
    sigs = np.full((num_perm, len(joined)), EMPTY_HASH, dtype=np.uint32)
    data, starts, ends, doc_of = batch_spans_utf8(joined, shingle_size)
    # Spans come grouped by document. A repeated shingle is not removed: the minimum is the same,
    # and sorting to find repeats cost more than permuting them.
    mixed = _fmix(span_hashes(data, starts, ends), _FMIX32)
    # Permutations x shingles, so that the per-document minimum runs over contiguous memory; one
    # buffer for every block (a fresh 4 MB array a block cost its page faults each time).
    buffer = np.empty((num_perm, min(_PERM_BLOCK, mixed.size)), dtype=np.uint32)
    for lo in range(0, mixed.size, _PERM_BLOCK):
        block = buffer[:, : min(_PERM_BLOCK, mixed.size - lo)]
        np.multiply(a[:, None], mixed[None, lo : lo + _PERM_BLOCK], out=block)
        block += b[:, None]
        docs = doc_of[lo : lo + _PERM_BLOCK]
        first = np.flatnonzero(np.concatenate(([True], docs[1:] != docs[:-1])))
        rows = docs[first]
        sigs[:, rows] = np.minimum(sigs[:, rows], np.minimum.reduceat(block, first, axis=1))
    return np.ascontiguousarray(sigs.T)


def batch_spans(joined: Sequence[str], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`batch_spans_utf8` of texts in `shingle_text` form."""
    return batch_spans_utf8([t.encode("utf-8", "surrogatepass") for t in joined], size)


def batch_spans_utf8(encoded: Sequence[bytes], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data, starts, ends, owners): the UTF-8 texts (each its `shingle_text`) end to end, and each
    shingle's byte span and text index, ascending by start — `shingle_spans` of every text, computed
    for the whole batch without a Python loop over shingles."""
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    lengths = np.diff(offsets)
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    # `uses_word_shingles` of each text, from its bytes: its characters are its bytes less continuation bytes.
    is_char = (data & 0xC0) != 0x80
    is_space = data == 0x20
    num_chars = lengths - np.diff(np.searchsorted(np.flatnonzero(~is_char), offsets))
    num_words = np.where(lengths > 0, np.diff(np.searchsorted(np.flatnonzero(is_space), offsets)) + 1, 0)
    word_mode = num_words >= size
    word_mode[word_mode] = num_chars[word_mode] / num_words[word_mode] <= UNSEGMENTED_WORD_LEN

    # Units: words (split at the single spaces) or characters (UTF-8 lead bytes), per text's mode.
    # One mask over the bytes marks where units start, so they come out in order without a sort.
    word_byte = np.repeat(word_mode, lengths)
    is_start = is_char & ~word_byte
    is_start[1:] |= is_space[:-1] & word_byte[1:]
    is_start[offsets[:-1][word_mode & (lengths > 0)]] = True
    unit_starts = np.flatnonzero(is_start)
    unit_owner = np.repeat(np.arange(len(encoded)), np.diff(np.searchsorted(unit_starts, offsets)))
    # A unit ends where the next begins (a word: at the space before it), or at its text's end.
    unit_ends = np.append(unit_starts[1:], data.size) - word_byte[unit_starts]
    last_unit = np.ones(unit_owner.size, dtype=bool)
    last_unit[:-1] = unit_owner[1:] != unit_owner[:-1]
    unit_ends[last_unit] = offsets[unit_owner[last_unit] + 1]

    # n-grams of `size` consecutive units of one text; a text of fewer units is one shingle.
    last = size - 1
    count = max(unit_owner.size - last, 0)
    same = unit_owner[:count] == unit_owner[last : last + count]
    starts = unit_starts[:count][same]
    ends = unit_ends[last : last + count][same]
    owners = unit_owner[:count][same]
    short = np.flatnonzero((np.bincount(unit_owner, minlength=len(encoded)) < size) & (lengths > 0))
    if short.size == 0:  # the usual batch: no copy of every span array to insert nothing
        return data, starts, ends, owners
    at = np.searchsorted(starts, offsets[short])
    return data, np.insert(starts, at, offsets[short]), np.insert(ends, at, offsets[short + 1]), np.insert(owners, at, short)


def _false_positive(threshold: float, bands: int, rows: int) -> float:
    from scipy.integrate import quad  # here: worker processes that only sign never need scipy

    return quad(lambda s: 1 - (1 - s ** float(rows)) ** float(bands), 0.0, threshold)[0]


def _false_negative(threshold: float, bands: int, rows: int) -> float:
    from scipy.integrate import quad

    return quad(lambda s: (1 - s ** float(rows)) ** float(bands), threshold, 1.0)[0]


@lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows) minimising fp_weight * P(candidate | J < t) + fn_weight * P(missed | J >= t),
    each integrated over J — the same search as datasketch's `MinHashLSH`, so both band alike."""
    best, best_error = (0, 0), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            error = (fp_weight * _false_positive(threshold, bands, rows)
                     + fn_weight * _false_negative(threshold, bands, rows))
            if error < best_error:
                best, best_error = (bands, rows), error
    return best


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (band, document): equal bands give equal keys; a collision of unequal
    bands (odds ~n^2 / 2^64) only adds a candidate, which verification then rejects."""
    keys = np.zeros((bands, sigs.shape[0]), dtype=np.uint64)
    for band in range(bands):
        key = np.full(sigs.shape[0], band, dtype=np.uint64)
        for col in range(band * rows, (band + 1) * rows):
            key = _fmix(key ^ sigs[:, col].astype(np.uint64), _FMIX64) + np.uint64(col)
        keys[band] = key
    return keys


def candidate_pairs(keys: np.ndarray) -> np.ndarray:
    """Distinct (i, j), i < j, pairs of documents sharing a key in any band, sorted."""
    found = []
    for band_key in keys:
        order = np.argsort(band_key, kind="stable")
        sorted_keys = band_key[order]
        for step in range(1, BUCKET_WINDOW):
            same = np.flatnonzero(sorted_keys[:-step] == sorted_keys[step:])
            if same.size == 0:
                break  # no bucket spans `step`, so none spans more
            found.append(np.stack((order[same], order[same + step]), axis=1))
    return _distinct_pairs(found)


def bucket_tables(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per band, the keys sorted and the document each belongs to: the LSH's buckets as arrays."""
    order = np.argsort(keys, axis=1, kind="stable")
    return np.take_along_axis(keys, order, axis=1), order


def cross_candidate_pairs(new_keys: np.ndarray, table_keys: np.ndarray, table_docs: np.ndarray) -> np.ndarray:
    """Distinct (new, old) pairs sharing a band key with an indexed document (`bucket_tables`);
    each bucket offers its first `BUCKET_WINDOW` old members (lowest index)."""
    found = []
    for band_new, sorted_old, docs_old in zip(new_keys, table_keys, table_docs):
        lo = np.searchsorted(sorted_old, band_new, "left")
        hi = np.minimum(np.searchsorted(sorted_old, band_new, "right"), lo + BUCKET_WINDOW)
        counts = hi - lo
        new_idx = np.repeat(np.arange(band_new.size), counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        found.append(np.stack((new_idx, docs_old[np.repeat(lo, counts) + within]), axis=1))
    return _distinct_pairs(found)


def _distinct_pairs(found: list[np.ndarray]) -> np.ndarray:
    if not found:
        return np.zeros((0, 2), dtype=np.int64)
    pairs = np.concatenate(found).astype(np.int64)
    codes = np.unique((pairs[:, 0] << 32) | pairs[:, 1])  # one int64 per pair: far faster than unique(axis=0)
    return np.stack((codes >> 32, codes & 0xFFFFFFFF), axis=1)


def estimated_jaccard(sigs_a: np.ndarray, sigs_b: np.ndarray) -> np.ndarray:
    """Fraction of permutations on which row i of `sigs_a` and row i of `sigs_b` agree."""
    return (sigs_a == sigs_b).mean(axis=1) if sigs_a.size else np.zeros(len(sigs_a))
