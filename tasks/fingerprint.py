"""Content fingerprints of input files, so that a stage key changes when its input data does."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path


def fingerprint_paths(paths: Iterable[Path]) -> str:
    """sha256 over every file under `paths` (names relative to each root, then bytes).

    Content, not mtimes: a fresh clone of the same data must give the same keys.
    Missing paths are hashed as missing, so the stage itself reports them clearly.
    """
    digest = hashlib.sha256()
    for root in paths:
        root = Path(root)
        digest.update(f"root:{root.as_posix()}\n".encode())
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())
        else:
            digest.update(b"missing\n")
            continue
        for file in files:
            rel = file.relative_to(root).as_posix() if root.is_dir() else file.name
            digest.update(f"file:{rel}:{file.stat().st_size}\n".encode())
            with open(file, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()
