"""Single-process DCP checkpoints: atomic commit, pruning, and falling back past damaged ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.tasks.train.checkpoint import MARKER, checkpoint_dir, delete_checkpoints_after, kept_steps, steps_on_disk
from kiln.tasks.train.dcp import latest_intact_dcp, load_dcp, load_latest_dcp, save_dcp

SHARD = "__0_0.distcp"


def model_and_optimizer(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 4, bias=False)
    nn.init.constant_(model.weight, value)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def save(root: Path, step: int, keep: int = 3, keep_every: int | None = None) -> None:
    model, optimizer = model_and_optimizer(float(step))
    save_dcp(root, step, model, optimizer, {"note": step}, keep=keep, keep_every=keep_every)


def loaded_weight(path: Path) -> float:
    model, optimizer = model_and_optimizer(-1.0)
    load_dcp(path, model, optimizer)
    return model.weight[0, 0].item()


def test_save_prunes_and_loads_latest(tmp_path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000020", "step_0000030"]
    assert sorted(p.name for p in (tmp_path / "step_0000030").iterdir()) == [
        ".metadata", MARKER, SHARD, "train_state.json"]
    model, optimizer = model_and_optimizer(-1.0)
    assert load_latest_dcp(tmp_path, model, optimizer) == {"step": 30, "note": 30}
    assert torch.equal(model.weight, torch.full((4, 4), 30.0))


def test_empty_root_has_no_checkpoint(tmp_path) -> None:
    assert latest_intact_dcp(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["flip_byte", "no_marker", "truncate", "missing_file"])
def test_damaged_latest_falls_back_to_previous(tmp_path, damage: str) -> None:
    save(tmp_path, 10)
    save(tmp_path, 20)
    latest = checkpoint_dir(tmp_path, 20)
    data = (latest / SHARD).read_bytes()
    if damage == "flip_byte":
        (latest / SHARD).write_bytes(data[:-30] + bytes([data[-30] ^ 0xFF]) + data[-29:])
    elif damage == "no_marker":
        (latest / MARKER).unlink()
    elif damage == "truncate":
        (latest / SHARD).write_bytes(data[: len(data) // 2])
    else:
        (latest / ".metadata").unlink()
    with pytest.warns(UserWarning, match="step_0000020 is incomplete or corrupt"):
        found = latest_intact_dcp(tmp_path)
    assert found == checkpoint_dir(tmp_path, 10) and loaded_weight(found) == 10.0
    save(tmp_path, 20)  # rewriting the damaged step replaces it
    assert latest_intact_dcp(tmp_path) == latest and loaded_weight(latest) == 20.0


def test_keep_every_is_never_pruned(tmp_path) -> None:
    for step in range(10, 70, 10):
        save(tmp_path, step, keep=2, keep_every=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000020", "step_0000040", "step_0000050", "step_0000060"]


@pytest.mark.parametrize("keep,keep_every", [(2, 20), (2, None), (1, 30), (5, None)])
def test_the_config_check_predicts_what_pruning_leaves(tmp_path, keep, keep_every) -> None:
    """`kept_steps` (what the config check calls kept, before any training) is what `save_dcp` leaves."""
    for step in range(10, 70, 10):
        save(tmp_path, step, keep=keep, keep_every=keep_every)
    assert kept_steps(65, 10, keep, keep_every) == sorted(steps_on_disk(tmp_path))


def test_latest_before_a_step_and_delete_after_it(tmp_path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step)
    assert latest_intact_dcp(tmp_path, before=30) == checkpoint_dir(tmp_path, 20)
    assert latest_intact_dcp(tmp_path, before=21) == checkpoint_dir(tmp_path, 20)
    assert latest_intact_dcp(tmp_path, before=10) is None
    assert delete_checkpoints_after(tmp_path, 10) == [30, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000010"]
