"""Training health: spotting a bad step's loss, and the policy for rolling back past it.

The loop asks `check_loss` about every step's loss. An anomaly is a non-finite loss, or a spike:
a robust z-score (median and MAD of the previous `spike_window` accepted losses) above
`spike_zscore`. The loop then rolls back to the newest checkpoint before `rollback_bound` and
re-runs the steps up to the bad one on other data (PaLM's recipe): each rollback adds a
`SkipWindow` that shifts those steps' batch indices past every index the run would otherwise
use, so the replacement batches are fresh and deterministic. Windows are stored in the run's
`health_events.jsonl`, so a crashed run resumes with the same data a continuous one would use.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tasks.train.config import HealthConfig

EVENTS_FILE = "health_events.jsonl"
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
# the noise scale is at least 1% of the median, so a flat, nearly noise-free curve does not
# call a small wobble a spike
REL_SCALE_FLOOR = 0.01
MIN_HISTORY = 3  # fewer losses than this give no usable median/MAD


@dataclass(frozen=True)
class Anomaly:
    """A step whose loss the monitor rejects."""

    step: int
    kind: Literal["nonfinite", "spike"]
    loss: float
    zscore: float | None  # None for a non-finite loss
    median: float | None  # of the trailing window the z-score was measured against


def check_loss(step: int, loss: float, history: Sequence[float], cfg: HealthConfig) -> Anomaly | None:
    """The anomaly in `step`'s loss given the accepted losses before it (oldest first), or None."""
    if not cfg.enabled:
        return None
    if not math.isfinite(loss):
        return Anomaly(step, "nonfinite", loss, None, None)
    window = np.asarray(history[-cfg.spike_window :], dtype=np.float64)
    if step <= cfg.min_steps_before_check or len(window) < MIN_HISTORY:
        return None
    median = float(np.median(window))
    mad = float(np.median(np.abs(window - median)))
    scale = max(MAD_TO_SIGMA * mad, REL_SCALE_FLOOR * abs(median), 1e-12)
    z = (loss - median) / scale
    # only upward: a loss far below the trend is progress, not a fault
    return Anomaly(step, "spike", loss, z, median) if z > cfg.spike_zscore else None


@dataclass(frozen=True)
class SkipWindow:
    """Steps first_step..last_step (1-based, inclusive) re-run after a rollback, on other data.

    Their batch index becomes `step - 1 + data_offset`; steps first_step..lr_last_step also
    run at `lr_factor` times the scheduled learning rate.
    """

    first_step: int
    last_step: int
    data_offset: int
    lr_factor: float
    lr_last_step: int


def data_offset(rollback: int, total_steps: int) -> int:
    """Batch-index shift of the `rollback`-th rollback (1-based): past every index used before it."""
    return rollback * total_steps


def data_index(step: int, windows: Sequence[SkipWindow]) -> int:
    """The `batch_for_step` index for 1-based `step`; the latest window covering it wins."""
    index = step - 1
    for w in windows:
        if w.first_step <= step <= w.last_step:
            index = step - 1 + w.data_offset
    return index


def lr_factor(step: int, windows: Sequence[SkipWindow]) -> float:
    """Multiplier of `step`'s scheduled learning rate; the latest window covering it wins."""
    factor = 1.0
    for w in windows:
        if w.first_step <= step <= w.lr_last_step:
            factor = w.lr_factor
    return factor


def rollback_bound(bad_step: int, windows: Sequence[SkipWindow]) -> int:
    """Roll back to the newest checkpoint with a step strictly below this.

    Normally the bad step itself. When the very first step after the previous rollback fails,
    the checkpoint restored then is suspect too (a corrupting update can land in a checkpoint
    one step before its loss shows it), so the bound moves below that checkpoint.
    """
    if windows and bad_step == windows[-1].first_step:
        return windows[-1].first_step - 1
    return bad_step


class TrainingDivergedError(RuntimeError):
    """The loss stayed bad after `max_rollbacks` rollbacks; `events` holds the whole history."""

    def __init__(self, message: str, events: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.events = events


def json_float(x: float) -> float | str:
    """x itself when finite, else its name: the event files stay strict JSON."""
    return x if math.isfinite(x) else str(x)


def append_event(path: Path, event: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(event, allow_nan=False) + "\n")


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event recorded in `path` (none when it does not exist), oldest first."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def windows_from_events(events: Sequence[dict[str, Any]]) -> list[SkipWindow]:
    return [SkipWindow(**e["window"]) for e in events if e["action"] == "rollback"]
