"""Trial functions for sweep tests that must run in spawned worker processes (importable by path)."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.tasks.scaling.sweep import SweepConfig, Trial, TrialResult
from kiln.tasks.train.data_loader import Mixture

POISON_LR = 66.0  # a trial at this lr kills its worker process, as the OOM killer would


def fake_trial(cfg: SweepConfig, trial: Trial, mixture: Mixture, out_dir: Path) -> TrialResult:
    """No training: a loss that falls with width and is best at lr 1e-2; POISON_LR exits the process."""
    if trial.lr == POISON_LR:
        os._exit(1)
    loss = 10.0 * trial.width ** -0.3 * (1 + abs(trial.lr - 1e-2))
    tokens = trial.steps * trial.batch_size * cfg.run.seq_len
    return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size, 100 * trial.width,
                       10 * trial.width, loss, loss, {}, tokens, 0.0, steps=trial.steps, loss_curve=[(1, loss)],
                       kind=trial.kind, budget=trial.budget, weights=trial.weights, tokens=tokens)
