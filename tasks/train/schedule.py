"""Learning-rate schedules: linear warmup, then cosine / warmup-stable-decay / linear / 1-sqrt / constant.

Steps are 0-indexed optimizer updates in `[0, total_steps)`. Every decaying schedule reaches
`min_lr_ratio * lr` exactly at the last step, so `linear` or `1-sqrt` with `min_lr_ratio=0` ends
at 0.0 (what annealing needs). `1-sqrt` (Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations") decays as 1 - sqrt(t / T): it leaves the LR lower
sooner than linear, which matched cosine's final loss in their WSD cooldowns.
"""

from __future__ import annotations

import math

from kiln.tasks.train.config import OptimConfig


def _progress(step: int, begin: int, last: int) -> float:
    """Fraction of the way from `begin` to `last`, clamped to [0, 1]."""
    if last <= begin:
        return 1.0 if step >= last else 0.0
    return min(1.0, max(0.0, (step - begin) / (last - begin)))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate for 0-indexed optimizer step `step` of a `total_steps`-step run."""
    if step < 0 or total_steps <= 0:
        raise ValueError(f"need 0 <= step and total_steps > 0, got step={step}, total_steps={total_steps}")
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        # (step + 1) so that the first update already moves the weights
        return peak * (step + 1) / cfg.warmup_steps
    last = total_steps - 1
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        p = _progress(step, cfg.warmup_steps, last)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    if cfg.schedule == "linear":
        p = _progress(step, cfg.warmup_steps, last)
        return peak - (peak - floor) * p
    if cfg.schedule == "1-sqrt":
        p = _progress(step, cfg.warmup_steps, last)
        return floor + (peak - floor) * (1.0 - math.sqrt(p))
    # wsd: hold the peak, then decay linearly over the last decay_fraction of the run
    decay_steps = round(cfg.decay_fraction * total_steps)
    if decay_steps == 0:
        return peak
    begin = max(cfg.warmup_steps, total_steps - decay_steps)
    return peak - (peak - floor) * _progress(step, begin, last)
