"""The persisted dedup index: what a later batch must be deduplicated against, without rehashing.

Holds every kept document's MinHash signature, exact-text digest, id, length, quality score and
a snippet, and the LSH bucket tables built from the signatures. It is saved as one `.npz` (no
pickles) plus `settings.json`, the settings the signatures depend on; loading it under other
settings is a config error, because signatures made differently never match.

The dedup stage never holds an index whole: each shard's kept documents are saved as a part
(`save_part`: one `.npy` per array, its bucket tables sorted), an earlier index is unpacked into
the same form (`unpack`, a copy of each array's bytes), and `save_merged` streams the parts into
the one `.npz`, rows part after part and each band's bucket table merged a key range at a time:
the arrays `DedupIndex.extended` would build, in bounded memory.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.data import minhash
from kiln.tasks.errors import ConfigError
from kiln.tasks.store import HashingFile

INDEX_DIR = "lsh_index"
INDEX_ARRAYS = "index.npz"
_SETTINGS = "settings.json"
DIGEST_BYTES = 16
SNIPPET_CHARS = 100


@dataclass(frozen=True)
class DedupIndex:
    settings: dict[str, Any]  # what signatures and band keys depend on (must include bands, rows, num_perm)
    ids: np.ndarray  # str
    digests: np.ndarray  # (n, DIGEST_BYTES) uint8: digest of the normalised text
    lengths: np.ndarray  # int64: characters of the original text
    quality: np.ndarray  # float64: metadata quality_score, NaN where absent
    snippets: np.ndarray  # str: the first SNIPPET_CHARS characters
    signatures: np.ndarray  # (n, num_perm) uint32
    in_lsh: np.ndarray  # bool: has shingles, so takes part in fuzzy matching
    table_keys: np.ndarray  # (bands, documents in the LSH) uint64, sorted per band
    table_docs: np.ndarray  # (bands, documents in the LSH) int64: index into the arrays above

    @classmethod
    def empty(cls, settings: dict[str, Any]) -> DedupIndex:
        bands = settings["bands"]
        return cls(
            settings=settings,
            ids=np.zeros(0, dtype=str),
            digests=np.zeros((0, DIGEST_BYTES), dtype=np.uint8),
            lengths=np.zeros(0, dtype=np.int64),
            quality=np.zeros(0, dtype=np.float64),
            snippets=np.zeros(0, dtype=str),
            signatures=np.zeros((0, settings["num_perm"]), dtype=np.uint32),
            in_lsh=np.zeros(0, dtype=bool),
            table_keys=np.zeros((bands, 0), dtype=np.uint64),
            table_docs=np.zeros((bands, 0), dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.ids)

    def extended(self, ids: np.ndarray, digests: np.ndarray, lengths: np.ndarray, quality: np.ndarray,
                 snippets: np.ndarray, signatures: np.ndarray, in_lsh: np.ndarray) -> DedupIndex:
        """This index plus newly kept documents (arrays, one row each: digests (k, DIGEST_BYTES) uint8);
        bucket tables rebuilt from the stored signatures."""
        all_sigs = np.concatenate((self.signatures, signatures))
        all_in_lsh = np.concatenate((self.in_lsh, in_lsh))
        members = np.flatnonzero(all_in_lsh)
        keys, order = minhash.bucket_tables(
            minhash.band_keys(all_sigs[members], self.settings["bands"], self.settings["rows"])
        )
        return replace(
            self,
            ids=np.concatenate((self.ids, _fitted(ids))),
            digests=np.concatenate((self.digests, np.asarray(digests, dtype=np.uint8).reshape(-1, DIGEST_BYTES))),
            lengths=np.concatenate((self.lengths, np.array(lengths, dtype=np.int64))),
            quality=np.concatenate((self.quality, np.array(quality, dtype=np.float64))),
            snippets=np.concatenate((self.snippets, _fitted(snippets))),
            signatures=all_sigs,
            in_lsh=all_in_lsh,
            table_keys=keys,
            table_docs=members[order],
        )

    def save(self, index_dir: Path) -> None:
        index_dir.mkdir(parents=True, exist_ok=True)
        (index_dir / _SETTINGS).write_text(json.dumps(self.settings, indent=2, sort_keys=True))
        with _hashed_archive(index_dir / INDEX_ARRAYS) as archive:  # np.savez's archive
            for name in _ARRAY_FIELDS:
                with archive.open(f"{name}.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, np.asanyarray(getattr(self, name)), allow_pickle=False)

    @classmethod
    def load(cls, index_dir: Path, settings: dict[str, Any]) -> DedupIndex:
        """The index saved in `index_dir`; raises ConfigError unless it was built with `settings`."""
        saved = check_settings(index_dir, settings)
        with np.load(index_dir / INDEX_ARRAYS, allow_pickle=False) as arrays:
            return cls(settings=saved, **{name: arrays[name] for name in arrays.files})

    def digest_list(self) -> list[bytes]:
        return [row.tobytes() for row in self.digests]

    def candidates(self, new_keys: np.ndarray) -> np.ndarray:
        """(new, indexed) document pairs that share an LSH bucket."""
        return minhash.cross_candidate_pairs(new_keys, self.table_keys, self.table_docs)


def check_settings(index_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings the index in `index_dir` was saved with (its arrays unread); raises ConfigError
    unless there is one, built with `settings`."""
    settings_file = index_dir / _SETTINGS
    if not settings_file.is_file():
        raise ConfigError(f"no dedup index at {index_dir} (missing {_SETTINGS}): point it at the "
                          f"{INDEX_DIR}/ folder a dedup run wrote")
    saved = json.loads(settings_file.read_text())
    if saved != settings:
        differ = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
        raise ConfigError(
            f"dedup index {index_dir} was built with other settings ({', '.join(differ)}: "
            f"index {[saved.get(k) for k in differ]}, config {[settings.get(k) for k in differ]}); "
            "use the dedup config it was built with, or rebuild the index"
        )
    return saved


TABLE_FIELDS = ("table_keys", "table_docs")
_MERGE_ENTRIES = 1 << 18  # bucket entries merged at once (4 MB of keys), whatever the index's size
_COPY_ROWS = 1 << 13  # rows of a part written at once (4 MB of signatures)


def part_file(folder: Path, name: str, field: str) -> Path:
    return folder / f"{name}.{field}.npy"


def save_part(folder: Path, name: str, settings: dict[str, Any], kept: np.ndarray, ids: np.ndarray,
              snippets: np.ndarray, signatures: np.ndarray, has_shingles: np.ndarray) -> None:
    """A shard's kept documents (`kept`: their rows, ascending) as a part `save_merged` reads: the rows
    stay in the shard's row files (`folder/name.FIELD.npy`, `has_shingles` for in_lsh); the part adds
    which rows (`name.kept_rows.npy`), the width its strings take (`kept_widths`) and its bucket tables
    (`kept_table_keys`, `kept_table_docs`: position among the kept rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    members = np.flatnonzero(has_shingles[kept])
    keys, order = minhash.bucket_tables(minhash.band_keys(signatures[kept[members]], settings["bands"],
                                                          settings["rows"]))
    widths = np.array([_fitted(ids[kept]).itemsize // 4, _fitted(snippets[kept]).itemsize // 4], dtype=np.int64)
    for field, array in (("kept_rows", np.asarray(kept, dtype=np.int64)), ("kept_widths", widths),
                         ("kept_table_keys", keys), ("kept_table_docs", members[order])):
        np.save(part_file(folder, name, field), array)


def unpack(index_dir: Path, settings: dict[str, Any], folder: Path, name: str) -> int:
    """The index saved in `index_dir` as a part (each array's `.npy` bytes copied out of the `.npz`,
    never loaded whole); returns its number of documents. Raises ConfigError as `DedupIndex.load`."""
    check_settings(index_dir, settings)
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(index_dir / INDEX_ARRAYS) as arrays:
        for field in _ARRAY_FIELDS:
            with arrays.open(f"{field}.npy") as source, part_file(folder, name, field).open("wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    return len(np.load(part_file(folder, name, "ids"), mmap_mode="r"))


class NpyReader:
    """Rows (or a band's slice) of a `.npy` file, read with plain reads: a memory map would count every
    page it touched as this process's own until it is dropped, and the merge touches every part."""

    def __init__(self, path: Path):
        self.file = path.open("rb")
        version = np.lib.format.read_magic(self.file)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        self.shape, _, self.dtype = read_header(self.file)
        self.offset = self.file.tell()
        self.row = int(np.prod(self.shape[1:], dtype=np.int64))  # elements per row

    def read(self, start: int, stop: int, band: int | None = None) -> np.ndarray:
        """Rows `start:stop`, or elements `start:stop` of row `band` (a bucket table's band)."""
        first = start * self.row if band is None else band * self.shape[1] + start
        count = (stop - start) * (self.row if band is None else 1)
        self.file.seek(self.offset + first * self.dtype.itemsize)
        data = np.fromfile(self.file, dtype=self.dtype, count=count)
        return data.reshape(-1, *self.shape[1:]) if band is None else data

    def close(self) -> None:
        self.file.close()


def _merge_tables(table_keys: list[NpyReader], table_docs: list[NpyReader], offsets: list[int], bands: int,
                  keys_out: Any, docs_out: Any) -> None:
    """Each band's bucket table over every part, as `bucket_tables` sorts it (keys, ties in document
    order), a key range of about `_MERGE_ENTRIES` entries at a time: keys to `keys_out`, documents to
    `docs_out`."""
    width = sum(reader.shape[1] for reader in table_keys)
    num_ranges = max(1, -(-width // _MERGE_ENTRIES))  # equal keys fall in one range; hashes spread evenly
    edges = np.array([(1 << 64) * i // num_ranges for i in range(1, num_ranges)], dtype=np.uint64)
    for band in range(bands):
        bounds = []  # each part's entries in each key range (a band's keys are sorted)
        for keys in table_keys:
            ends = np.searchsorted(keys.read(0, keys.shape[1], band), edges).tolist() if num_ranges > 1 else []
            bounds.append([0, *ends, keys.shape[1]])
        for r in range(num_ranges):
            keys = np.concatenate([k.read(b[r], b[r + 1], band) for k, b in zip(table_keys, bounds)])
            docs = np.concatenate([d.read(b[r], b[r + 1], band) + offset
                                   for d, b, offset in zip(table_docs, bounds, offsets)])
            # Sorted runs in document order (each part's band is sorted, ties in its order; parts come in
            # document order): a stable sort of the keys leaves ties in document order, as `bucket_tables`.
            order = np.argsort(keys, kind="stable")
            keys_out.write(keys[order].tobytes())
            docs_out.write(docs[order].astype(np.int64).tobytes())


def save_merged(index_dir: Path, settings: dict[str, Any], parts: list[tuple[Path, str]]) -> int:
    """Save the index of `parts` ((folder, name) of a `save_part` or an `unpack`, in document order) in
    `index_dir`: the arrays
    `DedupIndex.extended` builds from them, streamed (memory: a few chunks and one part's band of keys,
    whatever the index's size). Returns its number of documents."""
    if not parts:
        DedupIndex.empty(settings).save(index_dir)
        return 0
    index_dir.mkdir(parents=True, exist_ok=True)
    (index_dir / _SETTINGS).write_text(json.dumps(settings, indent=2, sort_keys=True))
    # A shard's part reads its kept rows out of its row files; an unpacked index's arrays are its rows.
    kept = [np.load(part_file(folder, name, "kept_rows")) if part_file(folder, name, "kept_rows").is_file() else None
            for folder, name in parts]
    stored = {"in_lsh": "has_shingles", "table_keys": "kept_table_keys", "table_docs": "kept_table_docs"}
    readers = {field: [NpyReader(part_file(folder, name, field if rows is None else stored.get(field, field)))
                       for (folder, name), rows in zip(parts, kept)] for field in _ARRAY_FIELDS}
    try:
        sizes = [reader.shape[0] if rows is None else len(rows) for reader, rows in zip(readers["ids"], kept)]
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        widths = [None if rows is None else np.load(part_file(folder, name, "kept_widths")).tolist()
                  for (folder, name), rows in zip(parts, kept)]
        bands = settings["bands"]
        width = sum(reader.shape[1] for reader in readers["table_keys"])
        docs_file = index_dir / ".table_docs"  # table_docs, sorted as table_keys is being written
        with _hashed_archive(index_dir / INDEX_ARRAYS) as archive:
            for field in _ARRAY_FIELDS:
                columns = readers[field]
                if field in TABLE_FIELDS:
                    shape, dtype = (bands, width), columns[0].dtype
                elif columns[0].dtype.kind == "U":  # the widest part's, as concatenating fitted strings gives
                    at = ("ids", "snippets").index(field)
                    dtype = np.dtype(f"<U{max(c.dtype.itemsize // 4 if w is None else w[at] for c, w in zip(columns, widths))}")
                    shape = (sum(sizes),)
                else:
                    dtype, shape = columns[0].dtype, (sum(sizes), *columns[0].shape[1:])
                with archive.open(f"{field}.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                               "fortran_order": False, "shape": shape})
                    if field == "table_docs":
                        with docs_file.open("rb") as sorted_docs:
                            shutil.copyfileobj(sorted_docs, out, 1 << 20)
                        docs_file.unlink()
                    elif field == "table_keys":
                        with docs_file.open("wb") as sorted_docs:
                            _merge_tables(readers["table_keys"], readers["table_docs"], offsets, bands, out,
                                          sorted_docs)
                    else:
                        for column, rows in zip(columns, kept):
                            for start in range(0, column.shape[0], _COPY_ROWS):
                                stop = min(column.shape[0], start + _COPY_ROWS)
                                block = column.read(start, stop)
                                if rows is not None:  # the block's kept rows
                                    block = block[rows[np.searchsorted(rows, start):np.searchsorted(rows, stop)] - start]
                                out.write(block.astype(dtype).tobytes())
    finally:
        for columns in readers.values():
            for reader in columns:
                reader.close()
    return sum(sizes)


@contextmanager
def _hashed_archive(path: Path) -> Iterator[zipfile.ZipFile]:
    """An uncompressed zip archive (np.savez's form) written into a file hashed as it goes, so the
    store's commit does not read the index again."""
    with HashingFile(path) as hashed, zipfile.ZipFile(hashed, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        yield archive


def _fitted(strings: np.ndarray) -> np.ndarray:
    """`strings` as the narrowest str array that holds them, as `np.array(list_of_str)` makes it: a slice
    of a wider array keeps its width, and the saved index would differ in its bytes."""
    strings = np.asarray(strings, dtype=str)
    return strings.astype(f"<U{max(1, int(np.char.str_len(strings).max()) if strings.size else 1)}")


def digest_array(digests: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_BYTES)


_ARRAY_FIELDS = [name for name in DedupIndex.__dataclass_fields__ if name != "settings"]
