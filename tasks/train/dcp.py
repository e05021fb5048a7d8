"""Sharded training checkpoints with `torch.distributed.checkpoint` (DCP): any layout in, any layout out.

`save_dcp` writes model + optimizer (through `get_state_dict`, so plain, DDP, FSDP2 and TP
models all give FQN-keyed state), the torch RNG state and a JSON `train_state` (step, curves,
whatever the caller needs) to `root/step_{step:07d}/`. Every rank writes its own shards into a
temporary directory; after a barrier rank 0 writes the `COMPLETE` marker (each file's SHA-256,
hashed by all ranks in parallel) and renames the directory into place, so a crash never leaves a
directory that looks complete. `load_latest_dcp` skips any checkpoint without a marker or whose
bytes no longer match it, and loads the newest intact one into whatever layout the caller has
built: DCP reshards by global shape, so a 2-rank FSDP2 checkpoint loads into 1 plain process.

Without a process group everything runs as a single process (DCP's `no_dist` mode). With one,
every rank must call these functions together, and `root` must be on a filesystem they share.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kiln.tasks.errors import InputError
from kiln.tasks.train.checkpoint import (
    MARKER,
    TMP_PREFIX,
    TRAIN_STATE_FILE,
    checkpoint_dir,
    commit_checkpoint,
    sha256_file,
    steps_on_disk,
)

# optimizer state keyed by parameter name (torchtitan's choice): param groups differ between
# layouts and pipeline stages, so DCP's default keying by group index cannot reshard across them
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # DCP warns on every call without a process group, even when told no_dist=True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _gather_dicts(local: dict[str, Any]) -> dict[str, Any]:
    """Every rank's `local` merged, on every rank."""
    if not dist.is_initialized():
        return local
    parts: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _digests(path: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each named file in path; the ranks split the hashing between them."""
    rank, world = _rank_world()
    local = {name: sha256_file(path / name) for name in sorted(names)[rank::world] if (path / name).is_file()}
    return _gather_dicts(local)


def save_dcp(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    keep: int,
    keep_every: int | None = None,
) -> Path:
    """Write the checkpoint for `step` (collective), then delete all but the newest `keep`
    (and those at multiples of `keep_every`). `train_state` must be JSON-serialisable."""
    rank, _ = _rank_world()
    final = checkpoint_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier save of this step
            shutil.rmtree(tmp)
        tmp.mkdir()
        (tmp / TRAIN_STATE_FILE).write_text(json.dumps({"step": step, **train_state}) + "\n")
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
    # a plain tensor counts as replicated: rank 0's RNG state is saved and every rank gets it back
    state = {"model": model_state, "optim": optim_state, "rng": torch.get_rng_state()}
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    _barrier()
    digests = _digests(tmp, [p.name for p in tmp.iterdir()])
    if rank == 0:
        commit_checkpoint(root, tmp, step, digests, keep, keep_every)
    _barrier()
    return final


def _intact(path: Path) -> bool:
    """Marker present and every file it lists unchanged (collective: all ranks agree)."""
    try:
        expected = json.loads((path / MARKER).read_text())["sha256"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return False
    return _digests(path, list(expected)) == expected


def latest_intact_dcp(root: Path, before: int | None = None) -> Path | None:
    """The newest checkpoint under root (with step < `before` if given) whose marker and bytes are
    intact (collective), warning about each newer one skipped; None when there is none."""
    for step in steps_on_disk(root):
        if before is not None and step >= before:
            continue
        path = checkpoint_dir(root, step)
        if _intact(path):
            return path
        warnings.warn(f"checkpoint {path} is incomplete or corrupt; trying an earlier one", stacklevel=2)
    return None


def read_train_state(path: Path) -> dict[str, Any]:
    """The JSON `train_state` saved with the checkpoint at `path`, with its "step"."""
    return json.loads((path / TRAIN_STATE_FILE).read_text())


def checkpoint_model(state: dict[str, Any]) -> dict[str, Any]:
    """The model config (as a dict) a checkpoint's weights go with: the one its step trained with (a data
    phase may have changed the rotary positions), else, for checkpoints written before that was kept, the
    run's own (its identity's)."""
    return state.get("model") or state["identity"]["model"]


def load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint at `path` into model, optimizer and the torch RNG, resharding to whatever
    layout they have (collective); returns its train_state."""
    # get_state_dict gives the layout to load into; it first creates empty optimizer state
    # with a zero-lr step, which the load then overwrites
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
    state = {"model": model_state, "optim": optim_state, "rng": torch.get_rng_state()}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=FLAT_OPTIMIZER)
    torch.set_rng_state(state["rng"])
    return read_train_state(path)


def load_latest_dcp(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Load the newest intact checkpoint under root (collective); its train_state, or None when there is none."""
    path = latest_intact_dcp(root)
    return load_dcp(path, model, optimizer) if path is not None else None


def load_model_weights(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load only the model weights of the checkpoint at `path` into a plain, unsharded model (one
    process, no process group; optimizer and RNG state are not read), after checking its marker
    and bytes; returns its train_state. Raises InputError when the checkpoint is incomplete or
    corrupt, e.g. because training is pruning it."""
    if not _intact(path):
        raise InputError(
            f"checkpoint {path} is incomplete or corrupt (no {MARKER} marker, or its files no longer "
            "match the digests in it): it may be being pruned by training; use another checkpoint"
        )
    # DCP loads just the keys asked for, resharding by global shape whatever layout saved them
    state = {"model": model.state_dict()}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
    return read_train_state(path)
