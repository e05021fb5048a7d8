"""The store: addressed, immutable stage outputs at `{root}/{stage}/{key}/`.

A stage writes into `{root}/{stage}/.{key}.partial/`; `commit` writes the completion manifest
last and renames the folder into place in one atomic step. A folder without a manifest is
never read, so a crashed worker cannot leave a half-written output for a later stage. The
partial folder's name is fixed per key, so a resumable stage (training) picks up its own
checkpoints after a crash while every other stage starts clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST_FILE = "_kiln_manifest.json"
KEY_LENGTH = 12


def stage_key(stage: str, identity: dict[str, Any], input_keys: dict[str, str], format_version: int) -> str:
    """Short hash of everything that determines a stage's output."""
    payload = {"stage": stage, "identity": identity, "inputs": input_keys, "format": format_version}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


class Store:
    """A local folder of stage outputs (object stores: see the README's scaling notes)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def partial_path(self, stage: str, key: str) -> Path:
        return self.root / stage / f".{key}.partial"

    def is_complete(self, stage: str, key: str) -> bool:
        return (self.path(stage, key) / MANIFEST_FILE).is_file()

    def manifest(self, stage: str, key: str) -> dict[str, Any]:
        path = self.path(stage, key) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"stage {stage} key {key} is not complete in {self.root}")
        return json.loads(path.read_text())

    def begin(self, stage: str, key: str, *, resumable: bool = False) -> Path:
        """Return an empty (or, if `resumable`, the previous attempt's) partial folder for the output."""
        partial = self.partial_path(stage, key)
        if partial.exists() and not resumable:
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        return partial

    def commit(self, stage: str, key: str, manifest: dict[str, Any]) -> Path:
        """Write the manifest last, then move the partial folder into place atomically."""
        partial = self.partial_path(stage, key)
        final = self.path(stage, key)
        assert partial.is_dir(), f"commit without begin: {partial}"
        if final.exists():
            # Another worker finished the same key first; outputs are identical by construction.
            shutil.rmtree(partial)
            return final
        tmp = partial / (MANIFEST_FILE + ".tmp")
        with open(tmp, "w") as handle:
            json.dump(manifest, handle, indent=2, sort_keys=True, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, partial / MANIFEST_FILE)
        os.replace(partial, final)
        return final
