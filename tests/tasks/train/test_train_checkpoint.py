"""Atomic checkpoint writes, pruning, and falling back past incomplete or corrupt checkpoints."""

from __future__ import annotations

import pytest
import torch

from tasks.train.checkpoint import (
    MARKER,
    STATE_FILE,
    checkpoint_dir,
    delete_checkpoints_after,
    load_latest_checkpoint,
    save_checkpoint,
)


def test_save_prunes_and_loads_latest(tmp_path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"w": torch.full((3,), float(step))}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000020", "step_0000030"]
    step, state = load_latest_checkpoint(tmp_path)
    assert step == 30 and torch.equal(state["w"], torch.full((3,), 30.0))


def test_empty_root_has_no_checkpoint(tmp_path) -> None:
    assert load_latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", ["flip_byte", "no_marker", "truncate"])
def test_damaged_latest_falls_back_to_previous(tmp_path, damage: str) -> None:
    save_checkpoint(tmp_path, 10, {"w": torch.ones(4)}, keep=3)
    save_checkpoint(tmp_path, 20, {"w": torch.zeros(4)}, keep=3)
    latest = checkpoint_dir(tmp_path, 20)
    data = (latest / STATE_FILE).read_bytes()
    if damage == "flip_byte":
        (latest / STATE_FILE).write_bytes(data[:-30] + bytes([data[-30] ^ 0xFF]) + data[-29:])
    elif damage == "no_marker":
        (latest / MARKER).unlink()
    else:
        (latest / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="step_0000020 is incomplete or corrupt"):
        step, state = load_latest_checkpoint(tmp_path)
    assert step == 10 and torch.equal(state["w"], torch.ones(4))
    # rewriting the damaged step replaces it
    save_checkpoint(tmp_path, 20, {"w": torch.full((4,), 2.0)}, keep=3)
    assert load_latest_checkpoint(tmp_path)[0] == 20


def test_keep_every_is_never_pruned(tmp_path) -> None:
    for step in range(10, 70, 10):
        save_checkpoint(tmp_path, step, {"w": torch.zeros(1)}, keep=2, keep_every=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000020", "step_0000040", "step_0000050", "step_0000060"]


def test_load_before_a_step_and_delete_after_it(tmp_path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"w": torch.full((1,), float(step))}, keep=3)
    assert load_latest_checkpoint(tmp_path, before=30)[0] == 20
    assert load_latest_checkpoint(tmp_path, before=21)[0] == 20
    assert load_latest_checkpoint(tmp_path, before=10) is None
    assert delete_checkpoints_after(tmp_path, 10) == [30, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000010"]
