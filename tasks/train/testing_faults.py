"""Faults for tests, as a training callback: bad data, a wrecking learning rate, a rank that dies.

Production code never branches on them: a test passes `FaultInjection(...)` in
`train_model(callbacks=[...])`, or `CallbackSpec.of(FaultInjection, ...)` to a torchrun launch,
whose workers build it from its dotted path like any other callback.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from kiln.tasks.train.trainer import TrainCallback

if TYPE_CHECKING:
    from kiln.tasks.train.trainer import Batch, StepOutput, Trainer

FAULT_MARKER = ".fault_injected"


class FaultInjection(TrainCallback):
    """`poison_data_index`: batch indices whose batch becomes one token id repeated (vocab_size - 1);
    a rollback's new indices miss it, as with bad data on disk. `lr_multiplier`: {step: factor}
    applied every time that step runs, a fault no rollback cures. `kill_rank_at_step`: [rank, step]
    SIGKILLs that rank once after the step (a marker in out_dir makes the relaunched job run
    clean), as a crashed node would. `pause_after_step`: {step: seconds} the step's end waits, a
    slow node (what watches a job from outside gets time to look while it still runs)."""

    def __init__(self, poison_data_index: Iterable[int] = (), lr_multiplier: Mapping[int | str, float] | None = None,
                 kill_rank_at_step: tuple[int, int] | list[int] | None = None,
                 pause_after_step: Mapping[int | str, float] | None = None) -> None:
        self.poison = frozenset(poison_data_index)
        self.lr_multiplier = {int(k): v for k, v in (lr_multiplier or {}).items()}  # JSON keys are strings
        self.kill_rank_at_step = tuple(kill_rank_at_step) if kill_rank_at_step is not None else None
        self.pause_after_step = {int(k): v for k, v in (pause_after_step or {}).items()}

    def pre_step(self, trainer: Trainer, batch: Batch) -> None:
        if batch.index in self.poison:
            token = trainer.mixture.vocab_size - 1
            batch.x, batch.y = torch.full_like(batch.x, token), torch.full_like(batch.y, token)
        batch.lr_scale = self.lr_multiplier.get(batch.step, 1.0)

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        time.sleep(self.pause_after_step.get(out.step, 0.0))
        if self.kill_rank_at_step is None:
            return
        rank, at_step = self.kill_rank_at_step
        marker = trainer.out_dir / FAULT_MARKER
        if out.step == at_step and trainer.layout.rank == rank and not marker.exists():
            marker.write_text(f"rank {rank} killed at step {out.step}\n")
            os.kill(os.getpid(), signal.SIGKILL)
