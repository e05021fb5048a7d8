"""The vectorised MinHash equals datasketch 2.0's, and its LSH banding finds datasketch's candidates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from datasketch import LeanMinHash, MinHash, MinHashLSH

from kiln.tasks.data import minhash
from kiln.tasks.data.dedup import DedupConfig, normalize, shingles

SAMPLE = Path(__file__).resolve().parents[3] / "data" / "sample"


def _real_texts() -> list[str]:
    """Man pages, Python source and multilingual docs (Japanese and Chinese among them), normalised."""
    prose = [p.read_text(encoding="utf-8") for p in sorted((SAMPLE / "prose").rglob("*.txt"))[:12]]
    lines = (SAMPLE / "code" / "code.jsonl").read_text(encoding="utf-8").splitlines()[:6]
    code = [json.loads(line)["text"] for line in lines]
    multi = [json.loads(line) for line in (SAMPLE / "multilingual" / "multilingual.jsonl").read_text().splitlines()]
    cjk = [r["text"] for r in multi if r["id"].startswith(("man-ja", "man-zh"))][:4]
    odd = ["", "   ", "word", "two words", "a b c d e", "人人生而自由", "x" * 3, "naïve ﬁne Ｆｕｌｌ"]
    cfg = DedupConfig()
    return [normalize(t, cfg) for t in prose + code + cjk + odd]


def _datasketch_signature(text: str, num_perm: int = 128, seed: int = 1) -> np.ndarray:
    reference = MinHash(num_perm=num_perm, seed=seed, hashfunc=minhash.shingle_hash32)
    reference.update_batch(shingles(text, 5))
    return reference.hashvalues


def test_signatures_equal_datasketch_minhash_with_the_same_hashfunc():
    texts = _real_texts()
    assert sum(minhash.uses_word_shingles(minhash.shingle_text(t), 5) for t in texts) >= 18
    assert any("\u3040" <= ch <= "\u30ff" for t in texts for ch in t)  # Japanese kana present
    sigs = minhash.signatures(texts, 5, 128, 1)
    assert sigs.shape == (len(texts), 128) and sigs.dtype == np.uint32
    for text, row in zip(texts, sigs):
        assert np.array_equal(row, _datasketch_signature(text)), text[:40]
    # Another seed and width: datasketch's permutations are reproduced, not just its defaults.
    other = minhash.signatures(texts[:3], 5, 64, 7)
    assert all(np.array_equal(r, _datasketch_signature(t, 64, 7)) for t, r in zip(texts[:3], other))
    assert np.array_equal(np.stack(minhash.permutations(64, 7)), MinHash(num_perm=64, seed=7).permutations)


def test_block_boundaries_and_batching_do_not_change_signatures(monkeypatch):
    texts = _real_texts()
    whole = minhash.signatures(texts, 5, 128, 1)
    monkeypatch.setattr(minhash, "_SPAN_BLOCK", 7)
    monkeypatch.setattr(minhash, "_PERM_BLOCK", 5)
    assert np.array_equal(minhash.signatures(texts, 5, 128, 1), whole)
    one_by_one = np.concatenate([minhash.signatures([t], 5, 128, 1) for t in texts])
    assert np.array_equal(one_by_one, whole)


def test_shingles_of_edge_cases():
    assert shingles("one two three", 2) == [b"one two", b"two three"]
    assert shingles("hi", 5) == [b"hi"]  # shorter than one shingle: the whole text
    assert shingles("a b", 5) == [b"a b"]  # fewer words than the shingle size: characters
    assert shingles("", 5) == [] and shingles("  \n ", 5) == []
    assert shingles("人人有权享有生命", 5) == sorted(g.encode() for g in ["人人有权享", "人有权享有", "有权享有生", "权享有生命"])
    assert shingles("x  y\n z", 2) == [b"x y", b"y z"]  # whitespace never changes shingles
    empty = minhash.signatures(["", "   "], 5, 16, 1)
    assert (empty == minhash.EMPTY_HASH).all()  # datasketch's empty MinHash


def test_shingle_hash_is_a_proper_32_bit_hash():
    values = {minhash.shingle_hash32(f"word {i}".encode()) for i in range(20000)}
    assert len(values) >= 19990  # ~0.05 collisions expected by the birthday bound
    assert minhash.shingle_hash32(b"\x00a") != minhash.shingle_hash32(b"a")
    assert all(0 <= v < 2**32 for v in values)


@pytest.mark.parametrize(("threshold", "fp", "fn"), [(0.7, 0.5, 0.5), (0.8, 0.5, 0.5), (0.8, 0.1, 0.9), (0.5, 0.5, 0.5)])
def test_lsh_params_match_datasketch(threshold, fp, fn):
    lsh = MinHashLSH(threshold=threshold, num_perm=128, weights=(fp, fn))
    assert minhash.lsh_params(threshold, 128, fp, fn) == (lsh.b, lsh.r)
    assert minhash.lsh_params(0.7, 128) == (14, 9)


def test_candidate_pairs_equal_datasketch_minhashlsh_queries():
    base = _real_texts()[:12]
    rng = np.random.default_rng(0)
    texts = list(base)
    for text in base:  # near copies at several distances, so some bands match and some do not
        words = text.split()
        for edits in (1, 5, 20):
            edited = list(words)
            for pos in rng.choice(len(words), size=min(edits, len(words)), replace=False):
                edited[pos] = f"edit{pos}"
            texts.append(" ".join(edited))
    sigs = minhash.signatures(texts, 5, 128, 1)
    bands, rows = minhash.lsh_params(0.7, 128)
    ours = {tuple(p) for p in minhash.candidate_pairs(minhash.band_keys(sigs, bands, rows)).tolist()}

    lsh = MinHashLSH(threshold=0.7, num_perm=128)
    theirs = set()
    for i, row in enumerate(sigs):
        sketch = LeanMinHash(seed=1, hashvalues=row, scheme="affine32")
        theirs |= {(j, i) for j in lsh.query(sketch)}
        lsh.insert(i, sketch)
    assert ours == theirs
    assert len(ours) >= 24  # the 1- and 5-edit copies of each text at least

    # The same pairs come from an index of the first half queried with the second half.
    half = len(texts) // 2
    table_keys, table_docs = minhash.bucket_tables(minhash.band_keys(sigs[:half], bands, rows))
    cross = minhash.cross_candidate_pairs(minhash.band_keys(sigs[half:], bands, rows), table_keys, table_docs)
    assert {(old, half + new) for new, old in cross.tolist()} == {(i, j) for i, j in theirs if i < half <= j}


def test_estimated_jaccard_is_the_fraction_of_agreeing_permutations():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.uint32)
    b = np.array([[1, 2, 0, 4], [0, 0, 0, 8]], dtype=np.uint32)
    assert minhash.estimated_jaccard(a, b).tolist() == [0.75, 0.25]
