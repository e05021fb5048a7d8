"""The on-disk layout of training checkpoints: step directories, the commit marker, pruning.

A checkpoint is `checkpoints/step_{step:07d}/` holding its files (written by `tasks.train.dcp`) and
a `COMPLETE` marker that records every file's SHA-256. It is written under a temporary name, the
marker last, and then renamed into place, so a crash never leaves a directory that looks
complete; a reader skips a checkpoint without a marker or whose bytes no longer match it.
Pruning keeps the newest `keep` checkpoints and, when `keep_every` is set, every checkpoint at a
multiple of it (for later evaluation or annealing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MARKER = "COMPLETE"
PREFIX = "step_"
TMP_PREFIX = ".tmp_"
TRAIN_STATE_FILE = "train_state.json"  # beside a checkpoint's tensors: its step, curves, loader position, mixtures
METRICS_FILE = "metrics.json"  # a finished run's result, in its folder (`tasks.train.trainer.write_metrics`)
# beside the checkpoints: the whole model as it stood before each data phase that changed its rotary
# positions (a context extension), `before_phase/<phase>/`, for the long-context evaluation
BEFORE_PHASE_DIR = "before_phase"


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


def kept_steps(steps: int, checkpoint_every: int, keep: int, keep_every: int | None) -> list[int]:
    """The checkpoints a finished run of `steps` steps leaves on disk, oldest first: those
    `commit_checkpoint`'s pruning spares (the newest `keep`, and every multiple of `keep_every`)."""
    written = list(range(checkpoint_every, steps + 1, checkpoint_every))
    newest = set(written[-keep:])
    return [s for s in written if s in newest or (keep_every is not None and s % keep_every == 0)]


def delete_checkpoints_after(root: Path, step: int) -> list[int]:
    """Delete every checkpoint later than `step` (a rolled-back trajectory's); returns their steps."""
    later = [s for s in steps_on_disk(root) if s > step]
    for s in later:
        shutil.rmtree(checkpoint_dir(root, s))
    return later


def mixture_history(run_folder: Path) -> list:
    """A train run's mixture history (entries of [steps trained before the mixture applied, its summary]):
    its finished result's, else its newest checkpoint's (a run still training); [] before either exists."""
    metrics = run_folder / METRICS_FILE
    if metrics.is_file():
        return json.loads(metrics.read_text())["mixture_history"]
    for step in steps_on_disk(run_folder / "checkpoints"):
        state = checkpoint_dir(run_folder / "checkpoints", step) / TRAIN_STATE_FILE
        if state.is_file():
            return json.loads(state.read_text()).get("mixture_history", [])
    return []
