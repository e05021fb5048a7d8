"""Training checkpoints on local disk: atomic writes, verified reads, pruning.

A checkpoint is `checkpoints/step_{step:07d}/` holding `state.pt` and a `COMPLETE` marker that
records the state file's SHA-256. It is written under a temporary name, the marker last, and
then renamed into place, so a crash never leaves a directory that looks complete. On reading,
a checkpoint without a marker or whose bytes no longer match it is skipped for the one before.
Pruning keeps the newest `keep` checkpoints and, when `keep_every` is set, every checkpoint at a
multiple of it (for later evaluation or annealing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
MARKER = "COMPLETE"
PREFIX = "step_"
TMP_PREFIX = ".tmp_"


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks (checkpoint markers hold one per file)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:07d}"


def steps_on_disk(root: Path) -> list[int]:
    """Steps of every step_* directory under root, newest first (complete or not)."""
    if not root.is_dir():
        return []
    steps = [int(p.name[len(PREFIX) :]) for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(steps, reverse=True)


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep: int, keep_every: int | None = None) -> Path:
    """Write `state` as the checkpoint for `step`, then delete all but the newest `keep`
    (and those at multiples of `keep_every`)."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    return commit_checkpoint(root, tmp, step, {STATE_FILE: sha256_file(tmp / STATE_FILE)}, keep, keep_every)


def commit_checkpoint(root: Path, tmp: Path, step: int, digests: dict[str, str], keep: int,
                      keep_every: int | None) -> Path:
    """Write the marker (each file's sha256) last, move `tmp` into place, then prune old checkpoints."""
    final = checkpoint_dir(root, step)
    with (tmp / MARKER).open("w") as f:
        json.dump({"step": step, "sha256": digests}, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        # a corrupt checkpoint for this step was skipped on resume; this one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in steps_on_disk(root)[keep:]:
        if keep_every is None or old % keep_every:
            shutil.rmtree(checkpoint_dir(root, old))
    return final


def delete_checkpoints_after(root: Path, step: int) -> list[int]:
    """Delete every checkpoint later than `step` (a rolled-back trajectory's); returns their steps."""
    later = [s for s in steps_on_disk(root) if s > step]
    for s in later:
        shutil.rmtree(checkpoint_dir(root, s))
    return later


def _verified(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        expected = json.loads(marker.read_text())["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    return all((path / name).is_file() and sha256_file(path / name) == digest for name, digest in expected.items())


def load_latest_checkpoint(root: Path, before: int | None = None) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of the newest intact checkpoint under root (with step < `before` if given),
    or None when there is none."""
    for step in steps_on_disk(root):
        if before is not None and step >= before:
            continue
        path = checkpoint_dir(root, step)
        if not _verified(path):
            warnings.warn(f"checkpoint {path} is incomplete or corrupt; trying an earlier one", stacklevel=2)
            continue
        return step, torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    return None
