"""The persisted dedup index: what a later batch must be deduplicated against, without rehashing.

Holds every kept document's MinHash signature, exact-text digest, id, length, quality score and
a snippet, and the LSH bucket tables built from the signatures. It is saved as one `.npz` (no
pickles) plus `settings.json`, the settings the signatures depend on; loading it under other
settings is a config error, because signatures made differently never match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.data import minhash
from kiln.tasks.errors import ConfigError

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
        np.savez(index_dir / INDEX_ARRAYS, **{name: getattr(self, name) for name in _ARRAY_FIELDS})

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


def _fitted(strings: np.ndarray) -> np.ndarray:
    """`strings` as the narrowest str array that holds them, as `np.array(list_of_str)` makes it: a slice
    of a wider array keeps its width, and the saved index would differ in its bytes."""
    strings = np.asarray(strings, dtype=str)
    return strings.astype(f"<U{max(1, int(np.char.str_len(strings).max()) if strings.size else 1)}")


def digest_array(digests: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_BYTES)


_ARRAY_FIELDS = [name for name in DedupIndex.__dataclass_fields__ if name != "settings"]
