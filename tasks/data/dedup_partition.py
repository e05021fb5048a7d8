"""Dedup's clustering without the corpus in one process: partitioned buckets, then components over
the duplicates alone (datatrove's sorted-bucket MinHash clustering, with Kiln's decisions).

`tasks.data.dedup.cluster` holds every document's ids, digests and signatures at once. This is the
same algorithm split so that no process holds more than a partition:

- `write_shard_rows` (the sign task, per shard): the shard's per-document arrays as `.npy` files a
  reader maps (`np.load(mmap_mode="r")`: it touches only the rows it gathers), and the shard's
  digests and LSH band keys split into `parts` partition files by hash (`NNNNN.pPPPPP.npz`); an
  earlier batch's index is split the same way once (`write_index_rows`).
- `cluster_partition` (a job, a rank per partition): every shard's (and the index's) entries of its
  partition. Exact copies are digest groups; fuzzy candidates are pairs within a (band, key) bucket,
  exactly as `minhash.candidate_pairs` and `cross_candidate_pairs` form them (new members in input
  order, pairs less than `BUCKET_WINDOW` apart; each new member with the bucket's first indexed
  ones), exact copies left out as `cluster` leaves them out (equal texts have equal signatures, so
  a document's copies share every bucket with it). Candidates are verified with the two documents'
  signatures, gathered from the mapped files. It writes the exact edges and the candidate pairs with
  their verdicts.
- `decide` (the driver): reads only the partitions' pairs and edges (as many as there are duplicates
  and candidates, not documents), finds components over the nodes that appear in them, gathers the
  ids, scores, lengths and digests of just those nodes and picks each cluster's survivor by
  `dedup.survivor_rank`'s order. Its decisions and stats equal `cluster`'s.

Nodes are numbered as `cluster` numbers them: indexed documents 0..m-1, then the new documents in
input order. A pair found in several bands (in several partitions) is counted once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.data import minhash
from kiln.tasks.data.dedup_index import DIGEST_BYTES, NpyReader, part_file, unpack

# What a reader gathers by row, one `.npy` file each (mapped, never read whole by the driver).
ROW_FIELDS = ("ids", "quality", "lengths", "snippets", "digests", "signatures", "has_shingles")
INDEX_RANK = 0  # the index's files are named as rank 0's of its own folder
_INDEX_CHUNK = 1 << 14  # index rows split at once (with their bucket entries: some 250,000 entries, 6 MB)
_NUM_SAMPLE_CLUSTERS = 5
_SAMPLE_MEMBERS = 10


def _row_file(folder: Path, rank: int, field: str) -> Path:
    return part_file(folder, f"{rank:05d}", field)


def _part_file(folder: Path, rank: int, part: int, chunk: int = 0) -> Path:
    return folder / f"{rank:05d}.p{part:05d}.c{chunk:05d}.npz"


def _digest_words(digests: np.ndarray) -> np.ndarray:
    """(n, 2) uint64: a digest's two halves, as `cluster` sorts them."""
    return np.ascontiguousarray(digests).view(np.uint64).reshape(-1, DIGEST_BYTES // 8)


def _write_parts(folder: Path, rank: int, parts: int, digest_rows: np.ndarray, digest_words: np.ndarray,
                 bands: np.ndarray, keys: np.ndarray, key_rows: np.ndarray, chunk: int = 0) -> None:
    """Split digest entries (row) and bucket entries (band, key, row) into `parts` files by hash: the
    digest's first half, the band key (both are already well mixed)."""
    digest_part = (digest_words[:, 0] % np.uint64(parts)).astype(np.int64) if digest_rows.size else digest_rows
    key_part = (keys % np.uint64(parts)).astype(np.int64)
    for part in range(parts):
        in_digest, in_key = digest_part == part, key_part == part
        np.savez(_part_file(folder, rank, part, chunk), digest_rows=digest_rows[in_digest], bands=bands[in_key],
                 keys=keys[in_key], key_rows=key_rows[in_key])


def write_shard_rows(signed: Any, folder: Path, rank: int, parts: int, band_rows: tuple[int, int],
                     exact: bool, fuzzy: bool) -> None:
    """Shard `rank`'s `SignedShard` as the partition job and the driver read it: its row files and its
    `parts` partition files (digest entries if `exact`; band keys of its documents with shingles if
    `fuzzy`, band-major)."""
    folder.mkdir(parents=True, exist_ok=True)
    for field in ROW_FIELDS:
        np.save(_row_file(folder, rank, field), getattr(signed, field))
    n = len(signed.ids)
    digest_rows = np.arange(n) if exact else np.zeros(0, dtype=np.int64)
    members = np.flatnonzero(signed.has_shingles) if fuzzy else np.zeros(0, dtype=np.int64)
    num_bands, rows = band_rows
    keys = minhash.band_keys(signed.signatures[members], num_bands, rows)
    _write_parts(folder, rank, parts, digest_rows, _digest_words(signed.digests[digest_rows]),
                 np.repeat(np.arange(num_bands), members.size), keys.ravel(), np.tile(members, num_bands))


def write_index_rows(index_dir: Path, settings: dict[str, Any], folder: Path, parts: int, exact: bool,
                     fuzzy: bool) -> tuple[int, int]:
    """An earlier batch's saved index as `write_shard_rows` writes a shard, `_INDEX_CHUNK` rows at a
    time (its bucket tables give the band keys of its documents in the LSH): unpacked, never loaded
    whole. Returns its number of documents and of chunk files per partition."""
    m = unpack(index_dir, settings, folder, f"{INDEX_RANK:05d}")
    # Plain reads, not memory maps: this runs in the driver on a local executor (a one-rank job), where a
    # map would count every page it touched.
    digests, table_keys, table_docs = (NpyReader(_row_file(folder, INDEX_RANK, field))
                                       for field in ("digests", "table_keys", "table_docs"))
    try:
        num_bands, width = table_keys.shape
        chunks = max(1, -(-m // _INDEX_CHUNK))
        for chunk in range(chunks):
            lo, hi = chunk * _INDEX_CHUNK, (chunk + 1) * _INDEX_CHUNK
            digest_rows = np.arange(lo, min(hi, m)) if exact else np.zeros(0, dtype=np.int64)
            span = max(0, min(hi, width) - lo) if fuzzy else 0
            keys = [table_keys.read(lo, lo + span, band) for band in range(num_bands)]
            docs = [table_docs.read(lo, lo + span, band) for band in range(num_bands)]
            _write_parts(folder, INDEX_RANK, parts, digest_rows, _digest_words(digests.read(lo, lo + digest_rows.size)),
                         np.repeat(np.arange(num_bands), span), np.concatenate(keys), np.concatenate(docs), chunk)
    finally:
        for reader in (digests, table_keys, table_docs):
            reader.close()
    return m, chunks


@dataclass(frozen=True)
class Rows:
    """Gathers per-document fields by node from mapped row files: the index's (nodes 0..m-1), then each
    shard's in input order."""

    signed: Path  # the shards' row files
    sizes: tuple[int, ...]  # documents per shard
    index: Path | None  # the index's row files, if any
    m: int  # indexed documents
    index_chunks: int = 1  # the index's partition files per partition

    def gather(self, field: str, nodes: np.ndarray) -> np.ndarray:
        """`field` of each node in `nodes`, in that order; only the rows asked for are read."""
        bounds = np.cumsum((0, self.m, *self.sizes))
        which = np.searchsorted(bounds, nodes, side="right") - 1
        pieces, order = [], []
        for source in np.unique(which).tolist():
            at = np.flatnonzero(which == source)
            path = (_row_file(self.index, INDEX_RANK, field) if source == 0 and self.index is not None  # type: ignore[arg-type]
                    else _row_file(self.signed, source - 1, field))
            pieces.append(np.load(path, mmap_mode="r")[nodes[at] - bounds[source]])
            order.append(at)
        if not pieces:
            return np.load(_row_file(self.signed, 0, field), mmap_mode="r")[:0] if self.sizes else np.zeros(0)
        gathered = np.concatenate(pieces) if len(pieces) > 1 else np.asarray(pieces[0])
        out = np.empty_like(gathered)
        out[np.concatenate(order)] = gathered
        return out


def _entries(rows: Rows, part: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Partition `part`'s entries over the index and every shard: digest nodes, and bucket (band, key,
    node) band-major within each source (each node's entries in band order)."""
    digest_nodes, bands, keys, key_nodes = [], [], [], []
    sources = ([(rows.index, INDEX_RANK, 0, rows.index_chunks)] if rows.index is not None else []) + [
        (rows.signed, rank, rows.m + offset, 1) for rank, offset in enumerate(np.cumsum((0, *rows.sizes))[:-1].tolist())]
    for folder, rank, offset, chunks in sources:
        source: list[list[np.ndarray]] = [[], [], [], []]
        for chunk in range(chunks):
            with np.load(_part_file(folder, rank, part, chunk), allow_pickle=False) as arrays:
                for column, name in zip(source, ("digest_rows", "bands", "keys", "key_rows")):
                    column.append(arrays[name])
        joined = [np.concatenate(column) if len(column) > 1 else column[0] for column in source]
        if chunks > 1:  # chunks are band-major each: the whole source becomes so
            by_band = np.argsort(joined[1], kind="stable")
            joined[1:] = [column[by_band] for column in joined[1:]]
        digest_nodes.append(joined[0] + offset)
        bands.append(joined[1])
        keys.append(joined[2])
        key_nodes.append(joined[3] + offset)
    join = lambda arrays, dtype: np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)  # noqa: E731
    return join(digest_nodes, np.int64), join(bands, np.int64), join(keys, np.uint64), join(key_nodes, np.int64)


def cluster_partition(rows: Rows, part: int, parts: int, exact: bool, verify_threshold: float, window: int
                      ) -> dict[str, np.ndarray]:
    """Partition `part` (of `parts`)'s exact edges (anchor, copy) and candidate pairs with their verdicts (see module)."""
    m = rows.m
    digest_nodes, bands, keys, key_nodes = _entries(rows, part)
    edges = np.zeros((0, 2), dtype=np.int64)
    if exact and digest_nodes.size:
        # Each copy links to its digest's anchor: the last indexed document with it, else its first new one.
        words = _digest_words(rows.gather("digests", digest_nodes))
        order = np.lexsort((np.where(digest_nodes < m, -1 - digest_nodes, digest_nodes), words[:, 1], words[:, 0]))
        starts = np.ones(order.size, dtype=bool)
        starts[1:] = (words[order[1:]] != words[order[:-1]]).any(axis=1)
        anchors = order[starts][np.cumsum(starts) - 1]
        copies = (order != anchors) & (digest_nodes[order] >= m)
        edges = np.stack((digest_nodes[anchors[copies]], digest_nodes[order[copies]]), axis=1)
    if exact and key_nodes.size and parts == 1:  # every digest is here: the exact copies are known
        keep = ~np.isin(key_nodes, edges[:, 1])
        bands, keys, key_nodes = bands[keep], keys[keep], key_nodes[keep]
    elif exact and key_nodes.size:
        # A new document is an exact copy, so out of the LSH, when an indexed or earlier document has its
        # digest. Equal texts have equal band keys, so a document's copies share each of its buckets:
        # grouping every node's first entry here (its lowest band: a source's entries are band-major)
        # by (band, key, digest) finds them.
        nodes, first_entry = np.unique(key_nodes, return_index=True)
        words = _digest_words(rows.gather("digests", nodes))
        first_bands, first_keys = bands[first_entry], keys[first_entry]
        order = np.lexsort((nodes, words[:, 1], words[:, 0], first_keys, first_bands))
        leads = np.ones(order.size, dtype=bool)
        leads[1:] = ((first_bands[order[1:]] != first_bands[order[:-1]]) | (first_keys[order[1:]] != first_keys[order[:-1]])
                     | (words[order[1:]] != words[order[:-1]]).any(axis=1))
        copies = nodes[order[~leads]]
        copies = copies[copies >= m]  # indexed documents sort first: a group led by one makes every new member a copy
        if copies.size:
            keep = ~np.isin(key_nodes, copies)
            bands, keys, key_nodes = bands[keep], keys[keep], key_nodes[keep]
    inner, cross = [], []
    by_band = np.argsort(bands, kind="stable")  # each source's entries are band-major: often sorted already
    bands, keys, key_nodes = bands[by_band], keys[by_band], key_nodes[by_band]
    band_starts = np.searchsorted(bands, np.arange(bands[-1] + 2)) if bands.size else np.zeros(1, dtype=np.int64)
    for lo_entry, hi_entry in zip(band_starts[:-1].tolist(), band_starts[1:].tolist()):
        band_nodes, band_keys = key_nodes[lo_entry:hi_entry], keys[lo_entry:hi_entry]
        new = band_nodes >= m
        new_nodes, new_keys = band_nodes[new], band_keys[new]
        order = np.lexsort((new_nodes, new_keys))  # as `candidate_pairs`: buckets in input order
        sorted_keys, sorted_nodes = new_keys[order], new_nodes[order]
        for step in range(1, window):
            same = np.flatnonzero(sorted_keys[:-step] == sorted_keys[step:])
            if same.size == 0:
                break
            inner.append(np.stack((sorted_nodes[same], sorted_nodes[same + step]), axis=1))
        old_nodes, old_keys = band_nodes[~new], band_keys[~new]
        if old_nodes.size and new_nodes.size:  # as `cross_candidate_pairs`: each bucket's first indexed members
            order = np.lexsort((old_nodes, old_keys))
            sorted_old, docs_old = old_keys[order], old_nodes[order]
            lo = np.searchsorted(sorted_old, new_keys, "left")
            hi = np.minimum(np.searchsorted(sorted_old, new_keys, "right"), lo + window)
            counts = hi - lo
            within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            cross.append(np.stack((np.repeat(new_nodes, counts), docs_old[np.repeat(lo, counts) + within]), axis=1))
    found = {"exact": edges, "inner": _distinct(np.concatenate(inner) if inner else np.zeros((0, 2), dtype=np.int64)),
             "cross": _distinct(np.concatenate(cross) if cross else np.zeros((0, 2), dtype=np.int64))}
    # Verified with the signatures of the nodes in pairs, each read once: the fraction of agreeing
    # permutations, as `minhash.estimated_jaccard` computes it (an exact count over num_perm).
    nodes, at = np.unique(np.concatenate((found["inner"], found["cross"])), return_inverse=True)
    at = at.reshape(-1, 2)
    sigs = rows.gather("signatures", nodes)
    agree = np.count_nonzero(sigs[at[:, 0]] == sigs[at[:, 1]], axis=1) / sigs.shape[1] if at.size else np.zeros(0)
    found["inner_verified"] = agree[:len(found["inner"])] >= verify_threshold
    found["cross_verified"] = agree[len(found["inner"]):] >= verify_threshold
    return found


def _distinct(pairs: np.ndarray) -> np.ndarray:
    """Distinct (a, b) rows, sorted."""
    if not len(pairs):
        return np.zeros((0, 2), dtype=np.int64)
    pairs = pairs.astype(np.int64)
    if pairs.max() >= 1 << 31:
        return np.unique(pairs, axis=0)
    codes = np.unique((pairs[:, 0] << 32) | pairs[:, 1])  # one int64 per pair: far faster than unique(axis=0)
    return np.stack((codes >> 32, codes & 0xFFFFFFFF), axis=1)


@dataclass
class Decisions:
    """`decide`'s result: as `dedup.Clustering`, with kept documents named by what they are not."""

    removed: list[dict[int, tuple[str, str]]]  # per shard: position -> (reason, survivor id)
    sizes: Counter[int]
    stats: dict[str, Any]


def decide(rows: Rows, found: list[dict[str, np.ndarray]], exact: bool, stats: dict[str, Any]) -> Decisions:
    """Clusters, survivors and decisions from every partition's `cluster_partition` (see module); `stats`
    holds the report's fixed part (lsh settings)."""
    from scipy.sparse import coo_matrix  # defers scipy
    from scipy.sparse.csgraph import connected_components  # defers scipy

    m = rows.m
    inner = _distinct(np.concatenate([f["inner"] for f in found] or [np.zeros((0, 2), dtype=np.int64)]))
    cross = _distinct(np.concatenate([f["cross"] for f in found] or [np.zeros((0, 2), dtype=np.int64)]))
    inner_ok = _distinct(np.concatenate([f["inner"][f["inner_verified"]] for f in found] or [inner[:0]]))
    cross_ok = _distinct(np.concatenate([f["cross"][f["cross_verified"]] for f in found] or [cross[:0]]))
    edges = np.concatenate([*(f["exact"] for f in found), inner_ok, cross_ok, np.zeros((0, 2), dtype=np.int64)])
    clustered, inverse = np.unique(edges, return_inverse=True)  # every node in an edge: all in clusters of 2+
    inverse = inverse.reshape(-1, 2)
    k = clustered.size
    graph = coo_matrix((np.ones(len(inverse)), (inverse[:, 0], inverse[:, 1])), shape=(k, k))
    labels = connected_components(graph, directed=False)[1] if k else np.zeros(0, dtype=np.int64)

    # Survivor of each cluster: an indexed document if any, else the best new one by `survivor_rank`.
    ids = rows.gather("ids", clustered)
    quality = rows.gather("quality", clustered)
    lengths = rows.gather("lengths", clustered)
    position = np.arange(k)
    survivor = position.copy()
    if k:
        id_rank = np.unique(ids, return_inverse=True)[1]
        ranked = np.lexsort((id_rank, -lengths, -np.nan_to_num(quality, nan=0.0), np.isnan(quality),
                             clustered >= m, labels))
        first = np.ones(k, dtype=bool)
        first[1:] = labels[ranked[1:]] != labels[ranked[:-1]]
        best_of_label = np.zeros(k, dtype=np.int64)
        best_of_label[labels[ranked[first]]] = ranked[first]
        survivor = best_of_label[labels]
    gone = np.flatnonzero((survivor != position) & (clustered >= m))
    is_exact = np.zeros(gone.size, dtype=bool)
    if exact and gone.size:
        digests = rows.gather("digests", clustered)
        is_exact = (digests[survivor[gone]] == digests[gone]).all(axis=1)
    reasons = np.where(is_exact, "exact_duplicate", "near_duplicate").tolist()
    survivor_ids = ids[survivor[gone]].tolist()
    bounds = np.cumsum((0, *rows.sizes))
    new_positions = clustered[gone] - m
    shard_of = np.searchsorted(bounds, new_positions, side="right") - 1
    removed: list[dict[int, tuple[str, str]]] = [{} for _ in rows.sizes]
    for i, (node, shard) in enumerate(zip(new_positions.tolist(), shard_of.tolist())):
        removed[shard][node - int(bounds[shard])] = (reasons[i], survivor_ids[i])

    sizes_by_label = np.bincount(labels) if k else np.zeros(0, dtype=np.int64)
    sizes = Counter({int(size): int(num) for size, num in zip(*np.unique(sizes_by_label, return_counts=True))})
    samples = sample_clusters(labels, clustered, survivor)
    shown = np.unique(np.array([i for _, c in samples for i in c], dtype=np.int64))  # only their snippets are read
    snippets = dict(zip(shown.tolist(), rows.gather("snippets", clustered[shown]).tolist()))
    report = {
        "num_clusters": int(sizes_by_label.size),
        "num_indexed_before": m,
        "num_candidate_pairs": len(inner) + len(cross),
        "num_verified_pairs": len(inner_ok) + len(cross_ok),
        **stats,
        "cluster_sizes": {str(size): num for size, num in sorted(sizes.items())},
        "sample_clusters": [
            {"survivor": str(ids[c[0]]), "size": size,
             "members": [{"id": str(ids[i]), "snippet": str(snippets[i])} for i in c]}
            for size, c in samples
        ],
    }
    return Decisions(removed, sizes, report)


def sample_clusters(labels: np.ndarray, clustered: np.ndarray, survivor: np.ndarray) -> list[tuple[int, list[int]]]:
    """The largest clusters (ties: smallest first member) as (size, positions in `clustered`), survivor
    first, then the others ascending; at most `_SAMPLE_MEMBERS` members each."""
    if not clustered.size:
        return []
    cluster_labels, first_member, size = np.unique(labels, return_index=True, return_counts=True)
    largest = np.lexsort((clustered[first_member], -size))[:_NUM_SAMPLE_CLUSTERS]
    samples = []
    for label, num in zip(cluster_labels[largest].tolist(), size[largest].tolist()):
        members = np.flatnonzero(labels == label)
        best = int(survivor[members[0]])
        samples.append((num, ([best] + [i for i in members.tolist() if i != best])[:_SAMPLE_MEMBERS]))
    return samples
