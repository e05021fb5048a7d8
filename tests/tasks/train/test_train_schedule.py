"""Learning-rate schedule shapes: warmup, each decay, and exact end points."""

from __future__ import annotations

import pytest

from tasks.train.config import OptimConfig
from tasks.train.schedule import lr_at


def curve(cfg: OptimConfig, total: int) -> list[float]:
    return [lr_at(s, cfg, total) for s in range(total)]


def test_warmup_is_linear_and_starts_above_zero() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="constant")
    assert curve(cfg, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_to_zero_ends_exactly_at_zero() -> None:
    cfg = OptimConfig(lr=0.5, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    lrs = curve(cfg, 5)
    assert lrs == [0.5, 0.375, 0.25, 0.125, 0.0]


def test_cosine_reaches_min_lr_at_last_step() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    lrs = curve(cfg, 13)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[-1] == pytest.approx(0.1, abs=1e-15)
    assert lrs[7] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay (steps 2..12)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_wsd_holds_then_decays_over_last_fraction() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    lrs = curve(cfg, 20)
    # decay covers the last 4 steps (16..19), starting from the peak at step 16
    assert lrs[1:17] == [1.0] * 16
    assert lrs[17:] == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_rejects_negative_step() -> None:
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, OptimConfig(), 10)
