"""The health monitor: the callback that rolls a run back past a bad step (policy in `tasks.train.health`).

Every step's loss (the global batch's mean, the same on every rank) goes through `check_loss`;
a non-finite loss or a spike rolls the run back, on every rank together, to the newest checkpoint
before it (`rollback_bound`), or to the initial weights when there is none, and adds a
`SkipWindow`, so that the steps up to the bad one re-run on other batches. Each rollback is
appended to `health_events.jsonl` with the data it skipped and reported through `on_event`;
after `max_rollbacks` the run stops with `TrainingDivergedError`. A run without anomalies is
bit-identical with or without the monitor.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kiln.tasks.errors import TrainingDivergedError
from kiln.tasks.train.checkpoint import delete_checkpoints_after
from kiln.tasks.train.data_loader import batch_sources
from kiln.tasks.train.dcp import latest_intact_dcp, read_train_state
from kiln.tasks.train.health import (
    EVENTS_FILE,
    Anomaly,
    SkipWindow,
    append_event,
    check_loss,
    data_index,
    data_offset,
    json_float,
    rollback_bound,
)
from kiln.tasks.train.plots import LOSS_PLOT, plot_loss_curve
from kiln.tasks.train.trainer import StepOutput, TrainCallback, Trainer

if TYPE_CHECKING:
    from pathlib import Path


class HealthMonitor(TrainCallback):
    """Rejects a step whose loss is anomalous by rolling the trainer back; `on_event` gets each event."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.on_event = on_event

    def check_step(self, trainer: Trainer, out: StepOutput) -> bool:
        health = trainer.run_cfg.health
        anomaly = check_loss(out.step, out.loss, trainer.curves["loss"][-health.spike_window:], health)
        if anomaly is None:
            return True
        self._roll_back(trainer, anomaly)
        return False

    def _record(self, trainer: Trainer, event: dict[str, Any]) -> None:
        trainer.events.append(event)
        if trainer.is_main:
            append_event(trainer.out_dir / EVENTS_FILE, event)
            if self.on_event is not None:
                self.on_event(event)

    def _roll_back(self, trainer: Trainer, anomaly: Anomaly) -> None:
        """Restore the newest checkpoint before the bad step (or the initial weights) on every rank."""
        t_detect = time.perf_counter()
        health, windows = trainer.run_cfg.health, trainer.windows
        if len(windows) >= health.max_rollbacks:
            self._record(trainer, {**_anomaly_record(anomaly), "action": "abort", "rollbacks": len(windows)})
            if trainer.is_main:
                plot_loss_curve(trainer.curves["loss"], [], trainer.events, trainer.out_dir / LOSS_PLOT)
            raise TrainingDivergedError(_diverged_message(trainer.events, trainer.out_dir / EVENTS_FILE),
                                        list(trainer.events))
        found = latest_intact_dcp(trainer.ckpt_root, before=rollback_bound(anomaly.step, windows))
        target = read_train_state(found)["step"] if found is not None else 0
        deleted = delete_checkpoints_after(trainer.ckpt_root, target) if trainer.is_main else []
        trainer.layout.barrier()
        trainer.restore(found)
        assert trainer.step == target, (trainer.step, target)
        skipped = _skipped_data(trainer, windows, target + 1, anomaly.step)
        window = SkipWindow(
            first_step=target + 1,
            last_step=anomaly.step,
            data_offset=data_offset(len(windows) + 1, trainer.run_cfg.steps),
            lr_factor=health.rollback_lr_factor,
            lr_last_step=target + health.rollback_lr_steps,
        )
        windows.append(window)
        self._record(trainer, {
            **_anomaly_record(anomaly),
            "action": "rollback",
            "rollback": len(windows),
            "rolled_back_to": target,
            "deleted_checkpoints": deleted,
            "window": asdict(window),
            "skipped_data": skipped,
            "time_to_resume_s": time.perf_counter() - t_detect,
        })


def _ranges(values: list[int]) -> list[list[int]]:
    """Consecutive runs of `values` as [first, last] pairs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return runs


def _skipped_data(trainer: Trainer, windows: list[SkipWindow], first: int, last: int) -> dict[str, Any]:
    """Which batches steps first..last used before a rollback replaced them: the bad step's rows
    (domain, token offset) in full and a count of rows per domain over all of them."""
    rows, seed = trainer.run_cfg.batch_size, trainer.run_cfg.seed
    steps = range(first, last + 1)
    indices = [data_index(step, windows) for step in steps]
    sources = []
    for step, index in zip(steps, indices):
        _, mixture, seq_len, slot = trainer.data_for(step)
        sources.append(batch_sources(mixture, seed, index, 0, 1, rows, seq_len, slot))
    return {
        "data_indices": _ranges(indices),
        "bad_batch": [[domain, offset] for domain, offset in sources[-1]],
        "rows_by_domain": dict(sorted(Counter(domain for batch in sources for domain, _ in batch).items())),
    }


def _anomaly_record(anomaly: Anomaly) -> dict[str, Any]:
    return {
        "step": anomaly.step,
        "kind": anomaly.kind,
        "loss": json_float(anomaly.loss),
        "zscore": anomaly.zscore,
        "median": anomaly.median,
    }


def _diverged_message(events: list[dict[str, Any]], events_path: Path) -> str:
    history = "; ".join(
        f"step {e['step']} {e['kind']} loss={e['loss']}"
        + (f" -> rolled back to {e['rolled_back_to']}" if e["action"] == "rollback" else " -> gave up")
        for e in events
    )
    return (
        f"training diverged: the loss was still bad after {sum(e['action'] == 'rollback' for e in events)} "
        f"rollbacks ({history}). Details in {events_path}. Lower the learning rate, inspect the skipped "
        "data, or raise train.run.health.max_rollbacks"
    )
