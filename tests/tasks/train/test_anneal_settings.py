"""The anneal run's settings: LR decayed to zero from a fraction of the plan's, and its own checkpoint cadence."""

from __future__ import annotations

from kiln.tasks.train.anneal import AnnealConfig, anneal_checkpointing, anneal_settings
from kiln.tasks.train.config import OptimConfig, TrainRunConfig


def test_the_anneal_checkpoints_on_its_own_cadence_or_the_train_runs():
    run = TrainRunConfig(steps=300, checkpoint_every=100, keep_every=200)
    assert anneal_checkpointing(AnnealConfig(), run) == {"checkpoint_every": 100, "keep_every": 200}
    optim, anneal_run = anneal_settings(AnnealConfig(steps=60, checkpoint_every=20, keep_every=20), OptimConfig(), run, lr=0.01)
    assert (anneal_run.steps, anneal_run.checkpoint_every, anneal_run.keep_every) == (60, 20, 20)
    assert (optim.lr, optim.schedule, optim.min_lr_ratio) == (0.005, "linear", 0.0)
    # runtime settings: they decide which checkpoints exist, not what the anneal produces
    assert AnnealConfig(checkpoint_every=20).identity() == AnnealConfig().identity()
