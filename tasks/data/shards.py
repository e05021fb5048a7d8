"""How a data stage's documents lie on disk: shards, listed with their counts.

Every data stage writes its kept documents and the records it removed or quarantined as shards of
zstd-compressed JSON lines (`tasks.data.documents`):

    documents/00000.jsonl.zst  removed/00000.jsonl.zst  quarantine/00000.jsonl.zst  ...
    document_shards.json       the listing: each shard's path, records and (uncompressed) bytes

and returns the listing in its stats, so the stage's manifest lists them too. Collect cuts its
output into shards of `collect.shard_bytes`; every later stage processes input shard i as rank i of
a job on `cluster.executor` and writes its own shard i of each kind (none where nothing went to
it). Reading the kept shards in order reads the documents in collect's order, whichever executor
and however many workers wrote them, so every stage's output equals what one process would write.
Why JSON lines and zstd rather than parquet: a document's `metadata` is free-form JSON (its keys
differ by source and grow stage by stage), which a JSON line keeps exactly and a parquet schema
would have to flatten or re-encode; a shard is a plain stream that any tool decompresses
(`zstdcat`), that datatrove's `JsonlReader` reads, and whose bytes are `Document.to_json_line`'s,
so a stage that keeps a document copies its line without re-serialising it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.tasks.data.documents import SHARD_SUFFIX, ShardWriter
from kiln.tasks.errors import InputError

LISTING_FILE = "document_shards.json"
DOCUMENTS, REMOVED, QUARANTINE = "documents", "removed", "quarantine"
KINDS = (DOCUMENTS, REMOVED, QUARANTINE)
LISTING_FORMAT = 1


def shard_name(index: int) -> str:
    return f"{index:05d}{SHARD_SUFFIX}"


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its path relative to the stage's folder, how many records and uncompressed bytes it holds."""

    path: str
    num_records: int
    num_bytes: int


def _entry(writer: ShardWriter, root: Path) -> dict[str, Any] | None:
    if writer.num_records == 0 and not writer.path.exists():
        return None
    return asdict(ShardInfo(writer.path.relative_to(root).as_posix(), writer.num_records, writer.num_bytes))


class RankShards:
    """The shards one rank writes for input shard `index`: kept, removed and quarantined, each created
    by its first record. Files an earlier attempt of the rank left are removed first."""

    def __init__(self, out_dir: Path, index: int):
        self.out_dir = out_dir
        self.kept, self.removed, self.quarantine = (ShardWriter(out_dir / kind / shard_name(index)) for kind in KINDS)
        for writer in self.writers():
            writer.path.unlink(missing_ok=True)

    def writers(self) -> tuple[ShardWriter, ShardWriter, ShardWriter]:
        return self.kept, self.removed, self.quarantine

    def close(self) -> dict[str, dict[str, Any] | None]:
        """Close the files; each kind's listing entry (None: the rank wrote no such shard)."""
        for writer in self.writers():
            writer.close()
        return {kind: _entry(writer, self.out_dir) for kind, writer in zip(KINDS, self.writers())}

    def __enter__(self) -> RankShards:
        return self

    def __exit__(self, *exc: object) -> None:
        for writer in self.writers():
            writer.close()


class RotatingShards:
    """Records of one kind written in order into shards of about `max_bytes` (uncompressed) each: a
    new shard starts once the current one holds `max_bytes`. For a rank whose input is not one shard
    (collect's: a group of source files): `rank` names its shards `RRRRR.NNNNN.jsonl.zst`, so that
    its files are its rank's (`tasks.data.executors`), and in rank order they are the stage's order."""

    def __init__(self, out_dir: Path, kind: str, max_bytes: int, rank: int | None = None):
        self.out_dir, self.kind, self.max_bytes, self.rank = out_dir, kind, max_bytes, rank
        self.entries: list[dict[str, Any]] = []
        self._writer: ShardWriter | None = None

    def _current(self) -> ShardWriter:
        if self._writer is not None and self._writer.num_bytes >= self.max_bytes:
            self._finish()
        if self._writer is None:
            index = len(self.entries)
            name = shard_name(index) if self.rank is None else f"{self.rank:05d}.{shard_name(index)}"
            self._writer = ShardWriter(self.out_dir / self.kind / name)
        return self._writer

    def _finish(self) -> None:
        assert self._writer is not None
        self._writer.close()
        entry = _entry(self._writer, self.out_dir)
        assert entry is not None
        self.entries.append(entry)
        self._writer = None

    def write_line(self, line: bytes) -> None:
        self._current().write_line(line)

    def add(self, reason: str, record: dict[str, Any]) -> None:
        self._current().add(reason, record)

    def close(self) -> list[dict[str, Any]]:
        if self._writer is not None:
            self._finish()
        return self.entries

    def __enter__(self) -> RotatingShards:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()


def write_listing(out_dir: Path, shards: dict[str, list[dict[str, Any] | None]]) -> dict[str, Any]:
    """Write `document_shards.json` from each kind's entries in shard order (None entries, shards a
    rank did not write, are left out); returns the listing, for the stage's stats."""
    listing: dict[str, Any] = {"format": LISTING_FORMAT}
    for kind in KINDS:
        listing[kind] = [entry for entry in shards.get(kind, []) if entry is not None]
    (out_dir / LISTING_FILE).write_text(json.dumps(listing, indent=1) + "\n", encoding="utf-8")
    return listing


def read_listing(folder: Path) -> dict[str, list[ShardInfo]]:
    """A stage folder's shards by kind, from its `document_shards.json`."""
    path = folder / LISTING_FILE
    if not path.is_file():
        raise InputError(f"{folder} has no {LISTING_FILE}: it is not the output of a Kiln data stage (or one "
                         "written before documents moved as shards); rerun the stage that wrote it")
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {kind: [ShardInfo(**entry) for entry in raw[kind]] for kind in KINDS}


def shard_paths(folder: Path, kind: str = DOCUMENTS) -> list[Path]:
    """The shards of `kind` a data stage wrote into `folder`, in order."""
    return [folder / shard.path for shard in read_listing(folder)[kind]]


def document_files(path: Path) -> list[Path]:
    """The documents files `path` names: a Kiln data stage's folder (its kept shards), a folder of
    `.jsonl`/`.jsonl.zst` files (sorted), or one such file."""
    if path.is_dir():
        if (path / LISTING_FILE).is_file():
            return shard_paths(path)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".jsonl", SHARD_SUFFIX)))
        if not files:
            raise InputError(f"{path} holds no .jsonl or {SHARD_SUFFIX} files of Kiln documents")
        return files
    if not path.is_file():
        raise InputError(f"{path} does not exist")
    return [path]
