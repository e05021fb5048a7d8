"""The store: addressed, immutable stage outputs at `{root}/{stage}/{key}/`.

A stage writes into `{root}/{stage}/.{key}.partial/`; `commit` lists every output file with
its size and sha256 in the completion manifest, writes the manifest last and renames the
folder into place in one atomic step. A folder is complete only while its files match the
manifest: a deleted or truncated file makes it incomplete, and the next run redoes it. The
partial folder's name is fixed per key, so a resumable stage (training) picks up its own
checkpoints after a crash; `lock` keeps two writers of one key (two runs, two machines) apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kiln.tasks.keylock import KeyLock

MANIFEST_FILE = "_kiln_manifest.json"
FAILURE_FILE = "_kiln_failed.json"  # in a partial folder: why its attempt failed (`kiln status` shows it)
KEY_LENGTH = 12
_CHUNK = 1 << 20
_MAX_NOTED = 100_000  # files whose sha256 a writer noted, remembered at most (the oldest forgotten first)

log = logging.getLogger(__name__)


def stage_key(stage: str, identity: dict[str, Any], input_keys: dict[str, str], format_version: int) -> str:
    """Short hash of everything that determines a stage's output."""
    payload = {"stage": stage, "identity": identity, "inputs": input_keys, "format": format_version}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class HashingFile:
    """A binary file being written, hashed (sha256) as its bytes go by: `close` notes the digest
    (`note_sha256`), so the commit that lists the file need not read it back. Writes only, in order:
    it cannot seek, so a zip archive written into it streams (`zipfile` then writes each member's
    sizes after its data)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = open(self.path, "wb")
        self._digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()
            note_sha256(self.path, self._digest.hexdigest())

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Files whose writer hashed them while writing: absolute path -> (size, mtime_ns, ctime_ns, inode, sha256),
# trusted while the file's stat still says the same (a rewrite changes mtime or ctime, which no user can set
# back). `_pending`: noted and not yet taken by `take_noted` (a rank hands its files' digests to the driver).
_noted: dict[str, tuple[int, int, int, int, str]] = {}
_pending: list[list[Any]] = []


def _stat_key(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino


def note_sha256(path: Path, sha256: str) -> None:
    """Remember the sha256 of the file just written at `path` (its writer hashed every byte it wrote)."""
    entry = [str(Path(path).absolute()), *_stat_key(os.stat(path)), sha256]
    adopt_noted([entry])
    _pending.append(entry)


def take_noted() -> list[list[Any]]:
    """The digests noted in this process since the last call (JSON-able), for `adopt_noted` elsewhere."""
    taken = _pending[:]
    _pending.clear()
    return taken


def adopt_noted(entries: list[list[Any]]) -> None:
    """Remember digests another process noted (`take_noted`); each is trusted only while its file's stat matches."""
    for name, size, mtime_ns, ctime_ns, inode, sha256 in entries:
        _noted.pop(name, None)
        if len(_noted) >= _MAX_NOTED:
            del _noted[next(iter(_noted))]
        _noted[name] = (size, mtime_ns, ctime_ns, inode, sha256)


def known_sha256(path: Path) -> str:
    """`path`'s sha256: as its writer noted it if the file is unchanged since, else read and hashed now."""
    noted = _noted.get(str(Path(path).absolute()))
    if noted is not None and noted[:4] == _stat_key(os.stat(path)):
        return noted[4]
    return file_sha256(path)


def recorded_sha256(path: Path) -> str:
    """`path`'s sha256 as the manifest of the committed folder holding it records it (the store hashed
    every output at commit, so a stage reading another's output need not read it again), else hashed
    now: a file outside the store, or one changed since its folder was committed (another size, or
    modified after its manifest was written)."""
    path = Path(path).absolute()
    for folder in path.parents:
        manifest = folder / MANIFEST_FILE
        if manifest.is_file():
            listed = _listed_files(manifest, manifest.stat().st_mtime_ns).get(path.relative_to(folder).as_posix())
            stat = path.stat()
            if listed is not None and listed["size"] == stat.st_size and stat.st_mtime_ns <= manifest.stat().st_mtime_ns:
                return listed["sha256"]
            break
    return known_sha256(path)


@functools.lru_cache(maxsize=8)
def _listed_files(manifest: Path, mtime_ns: int) -> dict[str, dict[str, Any]]:
    """A manifest's file listing, read once per version of the manifest (`mtime_ns`)."""
    return json.loads(manifest.read_text()).get("files", {})


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a completion record (a manifest) as JSON, atomically and durably: the reader finds the
    whole record or none (a crash mid-write leaves only the temporary file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=2, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def list_files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` (but the manifest) as {relative path: {size, sha256}}; a file its writer
    hashed while writing it (`HashingFile`) is not read again."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != MANIFEST_FILE:
            files[rel] = {"size": path.stat().st_size, "sha256": known_sha256(path)}
    return files


class Store:
    """A local folder of stage outputs (object stores: see the README's scaling notes)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def partial_path(self, stage: str, key: str) -> Path:
        return self.root / stage / f".{key}.partial"

    def lock(self, stage: str, key: str, **options: Any) -> KeyLock:
        """The key's lock: hold it from checking completeness to committing (see `tasks.keylock`)."""
        return KeyLock(self.root / stage / f".{key}.lock", **options)

    def problems(self, stage: str, key: str, *, checksums: bool = False) -> list[str]:
        """Why `stage/key` is not complete (empty when it is): no manifest, or files that do not match it.

        Sizes are always compared; `checksums` also rehashes every file (slow on big outputs)."""
        folder = self.path(stage, key)
        manifest_path = folder / MANIFEST_FILE
        if not manifest_path.is_file():
            return [f"{folder} has no manifest"]
        listed = json.loads(manifest_path.read_text()).get("files", {})
        found = []
        for rel, expected in listed.items():
            path = folder / rel
            if not path.is_file():
                found.append(f"{rel} is missing")
            elif path.stat().st_size != expected["size"]:
                found.append(f"{rel} has {path.stat().st_size} bytes, the manifest says {expected['size']}")
            elif checksums and file_sha256(path) != expected["sha256"]:
                found.append(f"{rel} does not match its sha256 in the manifest")
        return found

    def is_complete(self, stage: str, key: str) -> bool:
        return not self.problems(stage, key)

    def manifest(self, stage: str, key: str) -> dict[str, Any]:
        path = self.path(stage, key) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"stage {stage} key {key} is not complete in {self.root}")
        return json.loads(path.read_text())

    def live_path(self, stage: str, key: str) -> Path | None:
        """Where the key's outputs are now: the committed folder, else a running or crashed attempt's
        partial folder (training checkpoints appear there first), else None."""
        for folder in (self.path(stage, key), self.partial_path(stage, key)):
            if folder.is_dir():
                return folder
        return None

    def begin(self, stage: str, key: str, *, resumable: bool = False) -> Path:
        """Return an empty (or, if `resumable`, the previous attempt's) partial folder for the output.

        A committed folder whose files no longer match its manifest is removed first, with a warning."""
        final = self.path(stage, key)
        if final.exists():
            log.warning("store: %s/%s is damaged (%s); redoing it", stage, key, "; ".join(self.problems(stage, key)))
            shutil.rmtree(final)
        partial = self.partial_path(stage, key)
        if partial.exists() and not resumable:
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        (partial / FAILURE_FILE).unlink(missing_ok=True)  # a resumed attempt is no longer the failed one
        return partial

    def record_failure(self, stage: str, key: str, failure: dict[str, Any]) -> None:
        """Keep why the attempt writing the partial folder failed, beside its files, until the next `begin`."""
        partial = self.partial_path(stage, key)
        if partial.is_dir():
            (partial / FAILURE_FILE).write_text(json.dumps(failure, indent=2, default=str))

    def failure(self, stage: str, key: str) -> dict[str, Any] | None:
        """What `record_failure` kept for the key's partial folder (None: no attempt failed, or one crashed)."""
        path = self.partial_path(stage, key) / FAILURE_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def commit(self, stage: str, key: str, manifest: dict[str, Any]) -> Path:
        """List the outputs in the manifest, write it last, then move the partial folder into place atomically."""
        partial = self.partial_path(stage, key)
        final = self.path(stage, key)
        assert partial.is_dir(), f"commit without begin: {partial}"
        assert not final.exists(), f"{final} exists: commit must run under the key's lock"
        write_record(partial / MANIFEST_FILE, {**manifest, "files": list_files(partial)})
        os.replace(partial, final)
        return final

    def partial_folders(self) -> list[Path]:
        """Every partial folder in the store: running, crashed, or abandoned attempts."""
        return sorted(self.root.glob("*/.*.partial"))

    def abandoned_partials(self, current_keys: dict[str, str] | None = None) -> list[Path]:
        """Partial folders no live process is writing, except those of `current_keys` (a crashed
        attempt of a key the config still wants is kept: training resumes from its checkpoints)."""
        current = {self.partial_path(stage, key) for stage, key in (current_keys or {}).items()}
        abandoned = []
        for folder in self.partial_folders():
            stage, key = folder.parent.name, folder.name[1:-len(".partial")]
            if folder not in current and not self.lock(stage, key).held():
                abandoned.append(folder)
        return abandoned

    def prune(self, folders: list[Path]) -> int:
        """Delete `folders` (from `abandoned_partials`); returns the bytes freed."""
        freed = 0
        for folder in folders:
            freed += sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder)
        return freed
