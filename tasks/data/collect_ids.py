"""Document ids that more than one of collect's tasks used, found without every id in one process.

Collect keeps the first record of each document id and quarantines every later record that reaches
the id check with an id already kept (`duplicate_id`, `tasks.data.collect._judge`). Its tasks read
their files apart, each knowing only its own ids, so each task writes the ids it checked, with
whether it kept each, as a sorted run (`write_checked`: 8-byte hashes sorted, and beside them the
ids themselves, to tell a true duplicate from a hash collision). `find_earlier_kept` then merges
the runs one slice of the hash space at a time, as a sorted-run merge does: its memory is one slice
of every task's run, however large the corpus. For each task it writes the ids the task checked
that an earlier task (in source and file order) kept: the task then runs again with those ids
already seen, which is what one process reading every source in order would have done. Document
ids start with their source's name, so such ids are rare: a source whose files repeat ids.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_HASH, _KEPT, _IDS, _OFFSETS = ".hash.npy", ".kept.npy", ".ids", ".offsets.npy"
# Entries (8-byte hash, flag, task, position: ~25 bytes) of every task's run per slice: ~50 MB at most.
SLICE_ENTRIES = 2_000_000


def id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def write_checked(stem: Path, ids: Sequence[str], kept: Sequence[bool]) -> None:
    """Write the ids one task checked (in its order) and whether it kept each, as a sorted run at `stem`
    (`stem.hash.npy`, `.kept.npy`, `.ids` and `.offsets.npy`)."""
    hashes = np.fromiter((id_hash(doc_id) for doc_id in ids), dtype=np.uint64, count=len(ids))
    order = np.argsort(hashes, kind="stable")
    encoded = [ids[i].encode("utf-8", "surrogatepass") for i in order]
    offsets = np.zeros(len(ids) + 1, dtype=np.uint64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    stem.parent.mkdir(parents=True, exist_ok=True)
    np.save(stem.with_name(stem.name + _HASH), hashes[order])
    np.save(stem.with_name(stem.name + _KEPT), np.asarray(kept, dtype=bool)[order] if len(ids) else np.zeros(0, bool))
    np.save(stem.with_name(stem.name + _OFFSETS), offsets)
    stem.with_name(stem.name + _IDS).write_bytes(b"".join(encoded))


class _Run:
    """One task's sorted run, memory-mapped, read slice by slice from a cursor."""

    def __init__(self, stem: Path):
        self.stem = stem
        self.hashes = np.load(stem.with_name(stem.name + _HASH), mmap_mode="r")
        self.kept = np.load(stem.with_name(stem.name + _KEPT), mmap_mode="r")
        self.offsets = np.load(stem.with_name(stem.name + _OFFSETS), mmap_mode="r")
        self.cursor = 0

    def take(self, end: int | None) -> tuple[int, int]:
        """The positions [start, stop) of the hashes below `end` (None: all that remain), from the cursor on."""
        start = self.cursor
        if end is None:
            stop = len(self.hashes)
        else:
            stop = start + int(np.searchsorted(self.hashes[start:], np.uint64(end), side="left"))
        self.cursor = stop
        return start, stop

    def ids(self, positions: np.ndarray) -> list[str]:
        with open(self.stem.with_name(self.stem.name + _IDS), "rb") as handle:
            out = []
            for position in positions:
                handle.seek(int(self.offsets[position]))
                out.append(handle.read(int(self.offsets[position + 1] - self.offsets[position]))
                           .decode("utf-8", "surrogatepass"))
            return out


def find_earlier_kept(stems: Sequence[Path], out_dir: Path, slice_entries: int = SLICE_ENTRIES) -> dict[int, Path]:
    """For each task t (its run at `stems[t]`, written by `write_checked`), the ids it checked that a task
    before it kept, written one JSON string a line to `out_dir/NNNNN.json` (in hash order); returns the
    files written, by task. Reads one slice of the hash space of every run at a time."""
    runs = [_Run(stem) for stem in stems]
    total = sum(len(run.hashes) for run in runs)
    num_slices = max(1, math.ceil(total / slice_entries))
    written: dict[int, Path] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for index in range(num_slices):
        end = None if index == num_slices - 1 else (2**64 * (index + 1)) // num_slices
        spans = [run.take(end) for run in runs]
        if sum(stop - start for start, stop in spans) == 0:
            continue
        hashes = np.concatenate([run.hashes[start:stop] for run, (start, stop) in zip(runs, spans)])
        kept = np.concatenate([run.kept[start:stop] for run, (start, stop) in zip(runs, spans)])
        tasks = np.concatenate([np.full(stop - start, t, dtype=np.int64) for t, (start, stop) in enumerate(spans)])
        positions = np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in spans])
        if not kept.any():
            continue
        # each kept hash's earliest task; a hash is suspect where a later task checked it
        kept_hashes, kept_tasks = hashes[kept], tasks[kept]
        order = np.lexsort((kept_tasks, kept_hashes))
        kept_hashes, kept_tasks = kept_hashes[order], kept_tasks[order]
        first = np.ones(len(kept_hashes), dtype=bool)
        first[1:] = kept_hashes[1:] != kept_hashes[:-1]
        unique_hashes, earliest = kept_hashes[first], kept_tasks[first]
        at = np.minimum(np.searchsorted(unique_hashes, hashes), len(unique_hashes) - 1)
        later = (unique_hashes[at] == hashes) & (tasks > earliest[at])
        if not later.any():
            continue
        # the suspects' ids themselves: a hash collision is no duplicate
        suspect = np.isin(hashes, np.unique(hashes[later]))
        entries: list[tuple[str, int, bool]] = []
        for t in np.unique(tasks[suspect]):
            mine = suspect & (tasks == t)
            ids = runs[int(t)].ids(positions[mine])
            entries += zip(ids, [int(t)] * len(ids), kept[mine].tolist())
        first_kept: dict[str, int] = {}
        for doc_id, t, was_kept in entries:
            if was_kept and t < first_kept.get(doc_id, len(runs)):
                first_kept[doc_id] = t
        found: dict[int, set[str]] = {}
        for doc_id, t, _ in entries:
            if doc_id in first_kept and t > first_kept[doc_id]:
                found.setdefault(t, set()).add(doc_id)
        for t, ids in sorted(found.items()):
            path = written.setdefault(t, out_dir / f"{t:05d}.json")
            with open(path, "a", encoding="utf-8") as handle:
                handle.writelines(json.dumps(doc_id) + "\n" for doc_id in sorted(ids))
    return written


def read_ids(path: Path | None) -> set[str]:
    """The ids of a file `find_earlier_kept` wrote (None: none)."""
    if path is None:
        return set()
    with open(path, encoding="utf-8") as handle:
        return {json.loads(line) for line in handle}
