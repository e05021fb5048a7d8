"""A source's files, wherever they are: a local path, a glob, or an fsspec URL (`s3://`, `file://`, ...).

Every reader opens its input through a `SourceFile`, so one code path serves a laptop folder and
an object store. Files come back in sorted order (by their path relative to the source) so that
`collect.max_docs_per_source` and document ids are the same on every machine. Compressed inputs
(`.gz`, `.zst`) are decompressed as streams: a line-oriented reader never holds a whole file.

Object stores are reached with the filesystem's own configuration: credentials and endpoints
from the environment (`AWS_ACCESS_KEY_ID`, `FSSPEC_S3_ENDPOINT_URL`, ...) or a source's
`storage_options`; nothing here knows one store from another.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.spec import AbstractBufferedFile

from kiln.tasks.bundled import locate
from kiln.tasks.errors import InputError

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}


@dataclass(frozen=True)
class SourceFile:
    """One input file: the filesystem that holds it, its full path there, its path relative to the source."""

    fs: AbstractFileSystem
    path: str
    rel: str
    size: int

    def open(self) -> BinaryIO:
        return self.fs.open(self.path, "rb")

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def is_remote(path: str) -> bool:
    """Whether `path` names something outside this machine's filesystem (a URL other than file://)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> Path | None:
    """The local path a source names (a plain path or a file:// URL, before any glob; Kiln's own file
    where this folder lacks it: `resolved`), else None."""
    if is_remote(path):
        return None
    return _split_glob(resolved(path).removeprefix("file://"))[0]


def resolved(path: str) -> str:
    """`path`, its local part replaced by Kiln's shipped file of that name where the working directory
    has none (`tasks.bundled.locate`: the default config's `data/sample/...` sources, read from any
    project folder) or where it says `kiln:`. URLs as they are; a glob keeps its pattern."""
    if is_remote(path) or path.startswith("file://"):
        return path
    base, pattern = _split_glob(path)
    located = locate(str(base))
    return path if located == base else str(located.joinpath(*pattern))


def _split_glob(path: str) -> tuple[Path, tuple[str, ...]]:
    """(the folder before a glob's first wildcard, the pattern's parts after it); a plain path is all folder."""
    parts = Path(path).parts
    first = next((i for i, part in enumerate(parts) if globlib.has_magic(part)), len(parts))
    return Path(*parts[:first] or ["."]), parts[first:]


def list_files(path: str, patterns: Iterable[str], storage_options: dict[str, Any] | None = None) -> list[SourceFile]:
    """The files a source names, sorted by relative path: `path` itself if it is a file, the files
    under it matching any of `patterns` if it is a folder, or the matches of `path` if it is a glob.
    InputError if nothing is there."""
    fs, root = url_to_fs(path, **(storage_options or {}))
    if globlib.has_magic(root):
        base = _glob_base(root)
        found = fs.glob(root, detail=True)
    elif fs.isfile(root):
        return [SourceFile(fs, root, root.rsplit("/", 1)[-1], fs.size(root))]
    elif fs.isdir(root):
        base = root.rstrip("/")
        found = {}
        for pattern in patterns:
            found |= fs.glob(f"{base}/{pattern}", detail=True)
    else:
        raise InputError(f"{path!r} does not exist")
    files = [
        SourceFile(fs, name, name[len(base):].lstrip("/") or name.rsplit("/", 1)[-1], int(info.get("size") or 0))
        for name, info in found.items() if info.get("type") == "file"
    ]
    return sorted(files, key=lambda file: file.rel)


def _glob_base(pattern: str) -> str:
    """The folder part of a glob before its first wildcard: relative paths are taken from there."""
    parts = pattern.split("/")
    return "/".join(parts[: next(i for i, part in enumerate(parts) if globlib.has_magic(part))])


def compression_of(name: str, compression: str = "infer") -> str | None:
    """"gzip", "zstd" or None: from the file name's suffix unless `compression` says otherwise."""
    if compression != "infer":
        return None if compression == "none" else compression
    return COMPRESSIONS.get(Path(name).suffix)


def decompressed(raw: BinaryIO, compression: str | None) -> BinaryIO:
    """A buffered binary stream of the file's content, whose `readline` takes a size limit. A corrupt
    stream raises (OSError, EOFError, zlib.error or zstandard.ZstdError) when read, not here: readers
    quarantine from that point."""
    if compression is None:
        # fsspec's remote files (s3fs, gcsfs, ...) are AbstractBufferedFiles whose readline() takes no
        # size: io.BufferedReader over their readinto gives the standard one. Local files have it already.
        return io.BufferedReader(raw) if isinstance(raw, AbstractBufferedFile) else raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    assert compression == "zstd", compression
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
    return io.BufferedReader(reader)


def remote_fingerprint(path: str, patterns: Iterable[str], storage_options: dict[str, Any] | None = None) -> str:
    """sha256 of a remote source's listing (names, sizes, ETags or checksums): its identity for the
    stage key, without downloading it. A store that rewrites an object changes its ETag."""
    listing = []
    for file in list_files(path, patterns, storage_options):
        info = file.fs.info(file.path)
        version = {key: str(info[key]) for key in ("ETag", "etag", "md5Hash", "crc32c", "VersionId", "mtime",
                                                   "LastModified") if info.get(key) is not None}
        listing.append({"rel": file.rel, "size": file.size, **version})
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()
