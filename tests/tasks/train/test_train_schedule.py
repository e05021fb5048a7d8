"""Learning-rate schedule shapes: warmup, each decay, and exact end points."""

from __future__ import annotations

import pytest

from kiln.tasks.train.config import OptimConfig
from kiln.tasks.train.schedule import lr_at


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


def test_one_minus_sqrt_decays_as_the_square_root_and_ends_exactly_at_zero() -> None:
    cfg = OptimConfig(lr=0.4, warmup_steps=0, schedule="1-sqrt", min_lr_ratio=0.0)
    # t/T = 0, 1/4, 1/2, 3/4, 1 over the 5 steps: 0.4 * (1 - sqrt(t/T))
    assert curve(cfg, 5) == [0.4, 0.2, 0.4 * (1 - 0.5 ** 0.5), 0.4 * (1 - 0.75 ** 0.5), 0.0]
    assert curve(cfg, 5)[2:4] == pytest.approx([0.11715728752538099, 0.05358983848622454], abs=1e-15)
    # below linear everywhere in between: it leaves the high LR sooner
    linear = curve(cfg.model_copy(update={"schedule": "linear"}), 5)
    assert all(s < l for s, l in zip(curve(cfg, 5)[1:4], linear[1:4]))


def test_one_minus_sqrt_after_warmup_ends_at_its_floor() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="1-sqrt", min_lr_ratio=0.1)
    lrs = curve(cfg, 7)  # warmup 0..1, decay over steps 2..6 (t/T = 0, 1/4, ..., 1)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[3] == 0.1 + 0.9 * 0.5 and lrs[-1] == 0.1


def test_wsd_holds_then_decays_over_last_fraction() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    lrs = curve(cfg, 20)
    # decay covers the last 4 steps (16..19), starting from the peak at step 16
    assert lrs[1:17] == [1.0] * 16
    assert lrs[17:] == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_rejects_negative_step() -> None:
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, OptimConfig(), 10)
