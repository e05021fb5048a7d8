"""Content fingerprints of input files, so that a stage key changes when its input data does.

A fingerprint hashes every file's path (relative to its root), size and content digest. Content,
not mtimes: a fresh clone of the same data gives the same keys. A root among Kiln's own files is
named by its `kiln:` name (`tasks.bundled`), so the keys of Kiln's sample do not depend on where
Kiln is installed (its checkout, a wheel in any venv, an image). Python's bytecode caches
(`__pycache__`) are no input: Python and pip write them wherever modules are imported or installed. But reading every byte of a corpus
each time a key is computed (every `kiln run`, `kiln stage`, `kiln status`) cost minutes per
hundred GB, so each file's sha256 is cached by what `stat` says of it (path, size, modification
and change times, inode): an unchanged file costs a stat, not a read. Any write to a file changes
its change time (ctime), which no tool can set back, so a rewritten file is read again even where
its size and mtime were restored (`rsync -t`, `tar`). A file changed within the last
`SETTLE_S` seconds is hashed but not cached: a filesystem with coarse timestamps could see it
change again within one tick, unseen by its stat.

The cache is a SQLite file in `$KILN_CACHE_DIR` (default `~/.cache/kiln`), shared by every work
dir on the machine: its entries are facts about files, whoever asks. Object stores are
fingerprinted by their listing's ETags and version ids instead (`tasks.data.source_files`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from kiln.tasks.bundled import packaged_name
from kiln.tasks.store import file_sha256

CACHE_ENV = "KILN_CACHE_DIR"
CACHE_FILE = "fingerprints.sqlite"
BYTECODE_CACHE = "__pycache__"
SETTLE_S = 2.0

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"


class DigestCache:
    """sha256 of files, remembered by (path, size, mtime, ctime, inode). Without a usable cache file (a
    read-only home, a damaged database) every file is read, with a warning: a key is never wrong for it."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / CACHE_FILE
        self.num_read = 0  # files whose bytes were read, in this object's life

    def digests(self, files: list[Path]) -> dict[Path, str]:
        stats = {file: file.stat() for file in files}
        known = self._lookup(stats)
        fresh: dict[Path, str] = {}
        settled: list[tuple] = []
        now = time.time_ns()
        for file, stat in stats.items():
            if file in known:
                continue
            fresh[file] = file_sha256(file)
            self.num_read += 1
            if now - max(stat.st_mtime_ns, stat.st_ctime_ns) > SETTLE_S * 1e9:
                settled.append((*_row(file, stat), fresh[file]))
        self._store(settled)
        return {file: known.get(file) or fresh[file] for file in files}

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=30)
        connection.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                           "ctime_ns INTEGER, inode INTEGER, sha256 TEXT)")
        return connection

    def _lookup(self, stats: dict[Path, os.stat_result]) -> dict[Path, str]:
        try:
            with self._connect() as connection:
                found = {}
                for file, stat in stats.items():
                    path, *facts = _row(file, stat)
                    row = connection.execute("SELECT size, mtime_ns, ctime_ns, inode, sha256 FROM digests WHERE path = ?",
                                             (path,)).fetchone()
                    if row is not None and list(row[:4]) == facts:
                        found[file] = row[4]
                return found
        except (sqlite3.Error, OSError) as err:
            log.warning("fingerprint cache %s unusable (%s): reading every input file", self.path, err)
            return {}

    def _store(self, rows: list[tuple]) -> None:
        if not rows:
            return
        try:
            with self._connect() as connection:
                connection.executemany("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?)", rows)
        except (sqlite3.Error, OSError) as err:
            log.warning("fingerprint cache %s unusable (%s): digests not kept", self.path, err)


def _row(file: Path, stat: os.stat_result) -> tuple[str, int, int, int, int]:
    return str(file.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino


def fingerprint_paths(paths: Iterable[Path], cache: DigestCache | None = None) -> str:
    """sha256 over every file under `paths`: each root, then each file's name relative to it, size and
    sha256 (from `cache`, by default the machine's). Missing paths are hashed as missing, so the stage
    itself reports them clearly."""
    cache = cache or DigestCache()
    digest = hashlib.sha256()
    for root in paths:
        root = Path(root)
        digest.update(f"root:{packaged_name(root) or root.as_posix()}\n".encode())
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and BYTECODE_CACHE not in p.relative_to(root).parts)
        else:
            digest.update(b"missing\n")
            continue
        digests = cache.digests(files)
        for file in files:
            rel = file.relative_to(root).as_posix() if root.is_dir() else file.name
            digest.update(f"file:{rel}:{file.stat().st_size}:{digests[file]}\n".encode())
    return digest.hexdigest()
